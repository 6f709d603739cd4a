"""load(path, mesh=...) reads each device's slices straight into the shardings of qwen_mtp/parallel/sharding.py, and an
orbax folder restores straight into them: on 8 virtual CPU devices (a subprocess: XLA_FLAGS must be set before jax
is imported; tests/sharded_load_worker.py), for the shipped bf16 model and a tiny MoE checkpoint with an MTP head
(per-expert trunk experts, fused MTP experts), unquantized and int4 (groups of 32), on meshes 1x4 and 2x2:
  - every array equal, bit for bit and sharding for sharding (QuantArray `spec` included), to load(path) followed
    by qwen_mtp.shard(model, mesh);
  - the reads from the safetensors file are slices: a tensor split over `model` is read as `model` slices, one per
    device column, and an unquantized load reads each element of the file exactly once (replicas share a read);
  - orbax folders written by qwen_mtp.save restore with mesh= equal to restore + shard (as saved, cast to bf16,
    int4) and the CRC-32 check still runs (a wrong CRC is refused). (Bitwise equality to shard(load(...)) makes
    the numerics those of tests/test_sharding.py, which runs sharded models end to end.)
"""

import os
from pathlib import Path

from subprocess_json import run_json

ROOT = Path(__file__).resolve().parent.parent


def test_sharded_load_reads_slices_into_the_shardings(ckpt, tmp_path, report):
    moe = ckpt("moe_mtp")[1]
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    figures = run_json(ROOT / "tests" / "sharded_load_worker.py", ROOT / "checkpoints" / "qwen3_5_small", moe, tmp_path,
                       env=env)
    report("sharded load (8 virtual CPU devices): " + ", ".join(f"{k} {v}" for k, v in figures.items()))
