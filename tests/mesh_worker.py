"""Sharded against single-device runs on virtual CPU devices; run in a subprocess by tests/test_sharding.py.

    python tests/mesh_worker.py OUT.json [--full [dense] [moe] [next]]

XLA_FLAGS=--xla_force_host_platform_device_count=8 is set here, before jax is imported. For each tiny checkpoint
(dense, MoE, Qwen3-Next; every tensor randomised, MTP head added, built with transformers as the tests build
them) and each mesh (data, model), it records against the same model on one device:
  - prefill logits (max abs / rel error, f32, highest precision),
  - greedy tokens of plain, speculative (native, k=2) and windowed (k=2, window 4, 1 sink) decoding of a ragged
    batch of two prompts, and sampled tokens (temperature 0.8, a seed) plain and speculative,
  - per-device parameter bytes against the whole,
  - the compiled plain decode step's collectives: all-reduces per decoder layer, the largest all-gather
    against the smallest sharded weight matrix; for dense, those of the speculative loops as XLA compiled them
    for generate (their optimized HLO dumped with --xla_dump_to while compiling, no second compile).
The short form (CI) runs every model on one mesh (dense 2x4, MoE 1x4, Qwen3-Next 2x2: prefill logits, bytes and
the decode step's collectives) with generate runs kept to dense plain, windowed and sampled speculative (whose
whole while_loop is inspected too) and MoE plain; --full runs the issue's sweep: every model, every run, on
(1,2), (1,4), (2,1), (2,2), (2,4).
"""

from __future__ import annotations

import os
import sys

# the test session's XLA flags (tests/xla_flags.py: LLVM at -O0, the classic loop emitters; both sides of every
# comparison run the same way): the short form in 37 s instead of 64 s on the 2-core host (2026-12-08);
# the speculative loops' optimized HLO is dumped as XLA compiles them for generate (read by spec_loop_collectives)
HLO_DUMP = __import__("tempfile").mkdtemp(prefix="qwen_mtp_mesh_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
                           f" --xla_dump_to={HLO_DUMP} --xla_dump_hlo_module_re=.*spec_decode.* --xla_dump_hlo_as_text")

import json
import math
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(Path(__file__).parent))

import hf_tiny

import qwen_mtp
from qwen_mtp.parallel import sharding
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.state import init_state

# vocab 96 (not the tests' 97) so the vocabulary splits over 2 and 4 devices; 4 heads, 2 kv heads (replicated on
# model=4: the "2 KV heads on 4 devices"), 4 GDN value heads
MODELS = {"dense": ("dense", 8, {"tie_word_embeddings": True, "embed_std": 0.6}, 3.0),
          "moe": ("moe", 9, {}, 2.0),
          "next": ("next", 6, {}, 2.0)}
# the short form (CI): every model, a few runs, each compile paid once
SHORT = {"dense": [(2, 4)], "moe": [(1, 4)], "next": [(2, 2)]}
SHORT_RUNS = {"dense": ("plain", "windowed", "sampled_spec"), "moe": ("plain",), "next": ()}
RUNS = ("plain", "spec", "windowed", "sampled", "sampled_spec")
FULL = [(1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
PROMPTS = [np.arange(3, 20) % 96, (np.arange(5, 14) * 7) % 96]
NEW = 12
HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}


def build(name, root):
    kind, seed, overrides, passthrough = MODELS[name]
    model = hf_tiny.make_hf_model(kind, seed, vocab_size=96, **overrides)
    folder = hf_tiny.save_hf(model, Path(root) / name)
    hf_tiny.add_mtp(folder, seed, passthrough)
    return qwen_mtp.load(folder, dtype="float32")


def runs(model, which):
    spec = qwen_mtp.SpecConfig(k=2)
    win = qwen_mtp.SpecConfig(k=2, window=4, sinks=1)
    kwargs = {"plain": {}, "spec": {"spec": spec}, "windowed": {"spec": win},
              "sampled": {"temperature": 0.8, "seed": 3}, "sampled_spec": {"spec": spec, "temperature": 0.8, "seed": 3}}
    out = {"logits": qwen_mtp.prefill_logits(model, PROMPTS[0])}
    for name in which:
        out[name] = qwen_mtp.generate(model, PROMPTS, NEW, eos_token_id=[], **kwargs[name]).tokens.tolist()
    return out


def collectives(model, mesh):
    """Collectives of the compiled one-token decode step of the sharded model (batch 2)."""
    cfg, B = model.config, 2
    st = init_state(cfg, B, 64, jnp.float32)
    st = jax.device_put(st, sharding.state_shardings(st, cfg, mesh, B))

    def step(w, tok, st, pos):
        h, st = forward(w, cfg, tok, st, pos, jnp.ones((B,), jnp.int32), gdn_mode="step")
        return jnp.argmax(lm_logits(w, h[:, 0]), -1), st

    with jax.set_mesh(mesh):
        txt = jax.jit(step).lower(model.weights, jnp.zeros((B, 1), jnp.int32), st,
                                  jnp.zeros((B,), jnp.int32)).compile().as_text()
    return count_collectives(txt)


def spec_loop_collectives(model, seen=set()):  # noqa: B006 (the dumps already read, across calls)
    """Collectives of the whole speculative loops (draft, verify, accept, rollback, refill) exactly as XLA
    compiled them for this sharded model's generate runs (their optimized HLO, dumped while compiling): counts
    and largest gather of the busiest, every gather's shape."""
    found = []
    for f in sorted(Path(HLO_DUMP).glob("*spec_decode*after_optimizations.txt")):
        txt = f.read_text()
        if f in seen or f"num_partitions={model.mesh.size}" not in txt.split("\n", 1)[0]:
            continue
        seen.add(f)
        found.append(count_collectives(txt))
    if not found:
        raise RuntimeError(f"no sharded speculative loop compiled into {HLO_DUMP}")
    ops, _, _ = max(found, key=lambda c: sum(c[0].values()))
    return ops, max(c[1] for c in found), [s for c in found for s in c[2]]


def count_collectives(txt):
    """({collective: count}, largest all-gather in bytes, [shape of every all-gather result])."""
    ops, gather_bytes, shapes = Counter(), [0], []
    for line in txt.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                      r"(-start)?\(", line)
        if m:
            ops[m.group(3)] += 1
            if m.group(3) == "all-gather":
                dims = [int(d) for d in m.group(2).split(",") if d]
                shapes.append(dims)
                n = math.prod(dims)
                gather_bytes[0] = max(gather_bytes[0], n * HLO_BYTES.get(m.group(1), 8))
    return dict(ops), gather_bytes[0], shapes


def sharded_weight_shapes(model):
    """The whole shapes of the weight arrays split on `model` (a gather of one would produce that shape)."""
    _, plan = sharding.weight_plan(model.weights, model.config, model.mesh)
    flat = {".".join(sharding.path_names(p)): w for p, w in jax.tree_util.tree_leaves_with_path(model.weights)}
    return sorted({tuple(flat[n].shape) for n, s in plan.specs.items() if "model" in tuple(s)})  # 1-D ones too


def smallest_sharded_matrix(model):
    """Bytes of the smallest weight matrix that is split on `model` (what a gather of a weight would move)."""
    _, plan = sharding.weight_plan(model.weights, model.config, model.mesh)
    flat = {".".join(sharding.path_names(p)): w for p, w in jax.tree_util.tree_leaves_with_path(model.weights)}
    sizes = [math.prod(flat[n].shape) * flat[n].dtype.itemsize for n, s in plan.specs.items()
             if flat[n].ndim >= 2 and "model" in tuple(s)]
    return min(sizes) if sizes else 0


def measured_bytes(model):
    """From the arrays as placed: bytes of the tensors split on `model` (whole, and as held by the first
    device) and of the rest (replicated)."""
    specs, _ = sharding.weight_plan(model.weights, model.config, model.mesh)
    dev = jax.devices()[0]
    out = {"sharded_bytes_total": 0, "sharded_bytes_per_device": 0, "replicated_bytes": 0}

    def visit(w, s):
        if w is None:
            return
        held = next(sh.data for sh in w.addressable_shards if sh.device == dev)
        if "model" in tuple(s):
            out["sharded_bytes_total"] += w.size * w.dtype.itemsize
            out["sharded_bytes_per_device"] += held.size * held.dtype.itemsize
        else:
            out["replicated_bytes"] += held.size * held.dtype.itemsize

    jax.tree.map(visit, model.weights, specs, is_leaf=lambda x: x is None)
    return out


def main(out, full, only=None):
    report = {}
    with tempfile.TemporaryDirectory() as root:
        for name in (only or MODELS):
            base_model = build(name, root)
            t = time.perf_counter()
            which = RUNS if full else SHORT_RUNS[name]
            base = runs(base_model, which)
            report[name] = {"single_s": time.perf_counter() - t, "meshes": {}}
            print(name, f"single device {time.perf_counter() - t:.1f} s", flush=True)
            for data, mp in (FULL if full else SHORT[name]):
                t = time.perf_counter()
                m = qwen_mtp.shard(base_model, sharding.make_mesh(data, mp))
                got = runs(m, which)
                max_rel, max_abs = hf_tiny.rel_err(got["logits"], base["logits"])
                per = sharding.device_bytes(m.weights)
                total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(base_model.weights))
                ops, gathered, gather_shapes = collectives(m, m.mesh)
                _, plan = sharding.weight_plan(m.weights, m.config, m.mesh)
                report[name]["meshes"][f"{data}x{mp}"] = {
                    "max_abs": max_abs, "max_rel": max_rel,
                    "runs": {k: got[k] == base[k] for k in which},
                    "plain_tokens": got.get("plain"),
                    "device_bytes_max": max(per.values()), "total_bytes": total, **measured_bytes(m),
                    "layer_types": list(m.config.layer_types),
                    "collectives": ops, "all_reduce_per_layer": ops.get("all-reduce", 0) / m.config.num_layers,
                    "max_all_gather_bytes": gathered, "smallest_sharded_matrix": smallest_sharded_matrix(m),
                    "all_gather_shapes": gather_shapes, "sharded_weight_shapes": sharded_weight_shapes(m),
                    "replicated": plan.replicated, "seconds": time.perf_counter() - t}
                if name == "dense":
                    ops, gathered, gather_shapes = spec_loop_collectives(m)
                    report[name]["meshes"][f"{data}x{mp}"].update(spec_loop_collectives=ops,
                                                                  spec_loop_max_all_gather_bytes=gathered,
                                                                  spec_loop_all_gather_shapes=gather_shapes)
                Path(out).write_text(json.dumps(report, indent=1))  # as it goes: a long sweep keeps what it ran
                print(name, data, mp, f"{time.perf_counter() - t:.1f} s", flush=True)
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    # --full [MODEL ...]: the whole sweep, or only the models named
    names = [a for a in sys.argv[2:] if a in MODELS]
    try:
        main(sys.argv[1], "--full" in sys.argv[2:], names or None)
    finally:
        __import__("shutil").rmtree(HLO_DUMP, ignore_errors=True)
