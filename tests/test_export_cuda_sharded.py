"""The speculative loop of an int4 Qwen3.5-27B-shaped model (real layer dimensions, 2 layers: one GDN, one gated
attention, and the MTP head; fp8 KV, Wind-MTP window) exported for cuda SHARDED over a (data=2, model=4) mesh of
8 virtual CPU devices (lowering.export_spec_decode(..., mesh=...)), batch 2.

What the exported StableHLO shows, and this test checks:
  - the arguments' shardings are recorded in the export and are the rule table's (sharding.weight_shardings);
  - every Pallas kernel call (the int4 matmul, the windowed draft attention) sits inside a shard_map region
    (sdy.manual_computation) and takes per-shard operands: each split weight's local packed values, never its
    whole array; the draft ring's local rows and kv heads; one batch row per data shard;
  - the only collectives the program writes are all_reduces inside those regions (the psum of row-parallel
    matmuls): no all_gather at all.
What it cannot show: the SPMD partitioner has not run on StableHLO (XLA runs it when the GPU compiles the
module), so the collectives it will add outside the regions are not in this text. The program's cpu lowering,
compiled on the same virtual mesh, is the proxy for those (lowering.manual_report's docstring); it costs ~20 s
of CPU compile, more than this test may take, and is left out.

Runs in a subprocess: the 8 devices must be set (XLA_FLAGS) before jax starts; `python
tests/test_export_cuda_sharded.py` is that subprocess.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from subprocess_json import run_json

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL, QMM, CAUSAL = "windowed_draft_attention", "quant_matmul_int4", "causal_attention"
DATA, MODEL, BATCH, CACHE, CAP = 2, 4, 2, 2048, 64


def check() -> dict:
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.decoding.speculative import SpecConfig
    from qwen_mtp.parallel import sharding
    from qwen_mtp.tools.lowering import export_spec_decode, manual_report
    from qwen_mtp.tools.real_shapes import _COMMON, REAL_CONFIGS
    from qwen_mtp.trunk import quant
    from qwen_mtp.trunk.config import parse_config
    from qwen_mtp.trunk.weights import weight_shapes

    raw = {**_COMMON, **REAL_CONFIGS["Qwen3.5-27B"], "num_hidden_layers": 2,
           "layer_types": ["linear_attention", "full_attention"]}
    cfg = parse_config(raw, "<Qwen3.5-27B, 2 layers>")
    spec = SpecConfig(k=4, window=4032, sinks=64)
    mesh = sharding.make_mesh(DATA, MODEL)
    weights = quant.abstract(weight_shapes(cfg, jnp.bfloat16), quant.QuantPolicy("int4"))
    exported = export_spec_decode(cfg, jnp.bfloat16, spec, Sampling(), batch=BATCH, cache_len=CACHE, cap=CAP,
                                  weights=weights, kv_dtype="float8_e4m3fn", mesh=mesh)
    assert exported.platforms == ("cuda",) and exported.nr_devices == DATA * MODEL

    # the weights' shardings, as recorded in the export, are the rule table's
    want = jax.tree.leaves(sharding.weight_shardings(weights, cfg, mesh))
    got = exported.in_shardings_jax(mesh)[:len(want)]
    avals = exported.in_avals[:len(want)]
    assert all(g.is_equivalent_to(w, len(a.shape)) for g, w, a in zip(got, want, avals)), \
        [(str(g.spec), str(w.spec)) for g, w in zip(got, want)]
    split = sum(any(s is not None for s in w.spec) for w in want)

    report = manual_report(exported)
    names = [k.name for k in report.kernels]
    # (the GDN rollback's kernel per shard too: gdn_rollback.py, per_shard.rollback_rows)
    assert set(names) == {QMM, QMM + "_mma", KERNEL, CAUSAL, "gdn_verify", "gdn_rollback"} and \
        names.count(KERNEL) == 2, names
    assert all(k.manual for k in report.kernels), [k.name for k in report.kernels if not k.manual]
    operands = {t for k in report.kernels for t in k.operands}

    # every split int4 matrix reaches a kernel as its local packed values, never whole
    matrices = [w for w in jax.tree.leaves(sharding.weight_plan(weights, cfg, mesh)[0],
                                           is_leaf=lambda x: isinstance(x, quant.QuantArray))
                if isinstance(w, quant.QuantArray)]
    shapes = [w for w in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
              if isinstance(w, quant.QuantArray)]
    checked = 0
    for plan, w in zip(matrices, shapes):
        q0, q1 = w.q.shape
        kax, nax = plan.spec
        if (kax, nax) == (None, None):
            continue
        l0, l1 = q0 // (mesh.shape[kax] if kax else 1), q1 // (mesh.shape[nax] if nax else 1)
        local = (f"tensor<{l0}x{l1}xui8>", f"tensor<{l0}x{l1 // 4}xi32>")  # packed bytes, or them as int32 words
        whole = (f"tensor<{q0}x{q1}xui8>", f"tensor<{q0}x{q1 // 4}xi32>")
        assert set(local) & operands and not set(whole) & operands, (w.shape, plan.spec, local)
        checked += 1
    assert checked == len(shapes), (checked, len(shapes))  # at (2, 4) every int4 matrix of the 27B splits
    # one batch row per data shard: a draft step's 1 row on the FMA decode kernel, a verify's k + 1 rows on the
    # tensor-core kernel's 16-row tile; both read x as it is (x's rows its first operand's first dimension)
    rows = {int(k.operands[0].split("<")[1].split("x")[0]) for k in report.kernels if k.name == QMM}
    assert rows == {1}, rows
    rows = {int(k.operands[0].split("<")[1].split("x")[0]) for k in report.kernels if k.name == QMM + "_mma"}
    assert rows == {BATCH // DATA * (spec.k + 1)} and BATCH // DATA * (spec.k + 1) <= 16, rows
    # the draft head's fp8 ring: its rows of this data shard and its kv heads of this model shard
    L, kv, hd = spec.sinks + spec.window + spec.k, cfg.num_kv_heads, cfg.head_dim
    ring = f"tensor<{BATCH // DATA}x{L}x{kv // MODEL}x{hd}xf8E4M3FN>"
    assert ring in operands and f"tensor<{BATCH}x{L}x{kv}x{hd}xf8E4M3FN>" not in operands, sorted(operands)
    # the GDN verify kernel (gdn_verify.py): the recurrent state of this data shard's rows and this model shard's
    # value heads, never the whole state
    nv, dk, dv = cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    assert f"tensor<{BATCH // DATA}x{nv // MODEL}x{dk}x{dv}xf32>" in operands, sorted(operands)
    assert f"tensor<{BATCH}x{nv}x{dk}x{dv}xf32>" not in operands

    # collectives written by the program: the row-parallel psums, inside their regions; no all_gather
    assert report.collectives and all(c == ("stablehlo.all_reduce", True) for c in report.collectives), \
        report.collectives
    text = exported.mlir_module()
    assert "stablehlo.all_gather" not in text and "sdy.mesh @mesh = <[\"data\"=2, \"model\"=4]>" in text
    return {"args": len(exported.in_avals), "split_weight_arrays": split, "kernel_sites": len(names),
            "int4_matrices_per_shard": checked, "regions": report.regions,
            "all_reduces": len(report.collectives), "module_mb": round(len(text) / 2**20, 1)}


def test_spec_loop_exports_sharded_for_cuda(report):
    out = run_json(__file__)
    report(f"sharded cuda export, int4 27B 2 layers on (data=2, model=4): {out}")


if __name__ == "__main__":
    print(json.dumps(check()))
