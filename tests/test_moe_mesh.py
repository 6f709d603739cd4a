"""The routed MoE experts under a mesh (kernels_pallas/per_shard.py `routed`): a tiny MoE block (8 experts of 64,
top-2, hidden 64) on (data=2, model=2) over 4 virtual CPU devices, its weights placed by the rule table
(sharding.weight_shardings: the experts' intermediate dimension over `model`, gate / up by columns, down by rows),
a decode step of 2 tokens (4 (token, expert) pairs, split over `data`):

  * equals the same block on one device, in f32 experts and int8 / int4 (groups of 32) / fp8 blocks (f32
    activations: tight); the moe_gemv reference runs per shard, the down projection's partial products summed by
    one psum. Control: without that psum the sharded block is far from the unsharded one;
  * exported for cuda under the mesh (int4 and bf16 experts), the block holds the moe_gemv kernel at every call
    site, each inside a shard_map region (sdy.manual_computation) and given the local expert slices, never the
    whole stacked experts; the only collectives it writes are the down projection's all_reduce inside its region.
    The router's top-k kernel (per_shard.router_rows) runs the same way on each shard's tokens, and in interpret
    mode per shard gives lax.top_k's values and ids.

Runs in a subprocess: the 4 devices must be set (XLA_FLAGS) before jax starts; `python tests/test_moe_mesh.py`
is that subprocess.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from subprocess_json import run_json

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               " --xla_backend_optimization_level=0")
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, I, E, TOPK = 64, 64, 8, 2


def check() -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from qwen_mtp.parallel import sharding
    from qwen_mtp.tools.lowering import export_for, manual_report, with_shardings
    from qwen_mtp.tools.real_shapes import config as real_config
    from qwen_mtp.trunk import mlp, quant
    from qwen_mtp.trunk.weights import MLPWeights, MoEWeights, weight_shapes

    cfg = dataclasses.replace(real_config("Qwen3.5-35B-A3B", layers=1), hidden_size=H, num_experts=E, top_k=TOPK,
                              moe_intermediate_size=I, shared_expert_intermediate_size=I, vocab_size=256)
    mesh = sharding.make_mesh(2, 2)
    is_q = lambda a: isinstance(a, quant.QuantArray)
    rng = np.random.default_rng(0)
    mat = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-2])).astype(np.float32)
    base = {"router": mat(H, E) * 4, "gate": mat(E, H, I), "up": mat(E, H, I), "down": mat(E, I, H),
            "shared": (mat(H, I), mat(H, I), mat(I, H)), "shared_gate": mat(H, 1)}
    x = jnp.asarray(rng.standard_normal((2, 1, H)), jnp.float32)  # batch 2, one token each: 4 pairs <= 8 experts
    assert mlp.reads_routed_only(2, cfg)

    def block(fmt):
        q = (lambda a: jnp.asarray(a)) if fmt == "f32" else (lambda a: quant.quantize(a, fmt, 32))
        w = MoEWeights(router=jnp.asarray(base["router"]), gate=q(base["gate"]), up=q(base["up"]),
                       down=q(base["down"]), shared=MLPWeights(*map(q, base["shared"])),
                       shared_gate=jnp.asarray(base["shared_gate"]))
        shapes = weight_shapes(cfg, jnp.float32, mtp=False)
        if fmt != "f32":
            shapes = quant.abstract(shapes, quant.QuantPolicy(fmt, 32))
        return w, sharding.weight_shardings(shapes, cfg, mesh).layers[0].mlp

    def place(w, sh):
        no_spec = lambda t: jax.tree.map(lambda a: dataclasses.replace(a, spec=None) if is_q(a) else a, t,
                                         is_leaf=is_q)
        placed = jax.tree.map(jax.device_put, no_spec(w), no_spec(sh))
        return jax.tree.map(lambda a, s: dataclasses.replace(a, spec=s.spec) if is_q(a) else a, placed, sh,
                            is_leaf=is_q)

    def sharded(w):
        with jax.set_mesh(mesh):
            return np.asarray(jax.jit(lambda x, w: mlp.moe(x, w, cfg))(x, w))  # a fresh function per call

    out = {}
    for fmt in ("f32", "int8", "int4", "fp8"):
        w, sh = block(fmt)
        specs = [s.spec if is_q(s) else tuple(s.spec)[1:] for s in (sh.gate, sh.up, sh.down)]
        assert specs == [(None, "model"), (None, "model"), ("model", None)], (fmt, specs)  # every matrix splits
        want = np.asarray(jax.jit(lambda x, w: mlp.moe(x, w, cfg))(x, w))
        pw = place(w, sh)
        got = sharded(pw)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        assert err < 1e-5, (fmt, err)
        out[fmt] = err
        if fmt in ("f32", "int4"):  # one token: its row padded to two (ops.two_rows), its 2 pairs on 2 shards of
            # `data` (per_shard.routed gathers each pair's row first)
            x1 = x[:1]
            want1 = np.asarray(jax.jit(lambda x, w: mlp.moe(x, w, cfg))(x1, w))
            with jax.set_mesh(mesh):
                got1 = np.asarray(jax.jit(lambda x, w: mlp.moe(x, w, cfg))(x1, pw))
            out[f"{fmt}_one_token"] = float(np.max(np.abs(got1 - want1)) / np.max(np.abs(want1)))
            assert out[f"{fmt}_one_token"] < 1e-5, out
        if fmt == "int4":  # control: the row-parallel down projection without its psum
            real = jax.lax.psum
            jax.lax.psum = lambda y, axis, **kw: y
            try:
                bad = sharded(pw)
            finally:
                jax.lax.psum = real
            out["control_no_psum"] = float(np.max(np.abs(bad - want)) / np.max(np.abs(want)))
            assert out["control_no_psum"] > 0.05, out

    # the router's top-k kernel (interpret mode) per shard, tokens over `data`: lax.top_k's values and ids
    from kernels_pallas import per_shard
    from kernels_pallas.moe_router import router_topk

    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((4, E)), jnp.float32), axis=-1)
    placed = jax.device_put(probs, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None)))
    with jax.set_mesh(mesh):
        top, ids = jax.jit(lambda p: per_shard.router_rows(
            lambda r: router_topk(r, k=TOPK, backend="pallas", interpret=True), p))(placed)
    want = jax.lax.top_k(probs, TOPK)
    assert (np.asarray(top) == np.asarray(want[0])).all() and (np.asarray(ids) == np.asarray(want[1])).all()
    out["router_topk_per_shard"] = "lax.top_k's bit for bit"

    # lowered for cuda under the mesh: the kernel per shard
    for fmt, kernel in (("int4", "moe_gemv_int4"), ("f32", "moe_gemv_plain")):
        w, sh = block(fmt)
        dt = jnp.bfloat16 if fmt == "f32" else jnp.float32
        abstract = jax.tree.map(lambda a, dt=dt: jax.ShapeDtypeStruct(a.shape, dt if a.dtype == jnp.float32
                                                                      else a.dtype), w)
        abstract = jax.tree.map(lambda a: dataclasses.replace(a, scale=jax.ShapeDtypeStruct(a.scale.shape,
                                                                                            jnp.float32))
                                if is_q(a) else a, abstract, is_leaf=is_q)
        args = with_shardings(abstract, sh)
        xs = jax.ShapeDtypeStruct(x.shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        with jax.set_mesh(mesh):
            exported = export_for(jax.jit(mlp.moe, static_argnums=2), xs, args, cfg, platform="cuda")
        rep = manual_report(exported)
        moe = [k for k in rep.kernels if k.name.startswith("moe_gemv")]  # beside them: the shared expert's matmuls
        assert [k.name for k in moe] == [kernel] * 2, rep.kernels  # gate and up share one lowered function
        assert all(k.manual for k in rep.kernels), rep.kernels
        # the router's top-k per shard: each its token's row of the 8 experts' probabilities
        (router,) = [k for k in rep.kernels if k.name == "moe_router_topk"]
        assert set(router.operands) == {"tensor<1x8xf32>"}, router.operands
        operands = {t for k in moe for t in k.operands}
        if fmt == "int4":  # packed [E, K/2, N] read as int32 words [E, K/2, N/4] (quant_gemv's kernel over the
            # pairs): gate / up local columns, down local rows
            local, whole = {"tensor<8x32x8xi32>", "tensor<8x16x16xi32>"}, {"tensor<8x32x16xi32>"}
        else:
            local, whole = {"tensor<8x64x32xbf16>", "tensor<8x32x64xbf16>"}, {"tensor<8x64x64xbf16>"}
        assert local <= operands and not whole & operands, (fmt, sorted(operands))
        assert rep.collectives and all(c == ("stablehlo.all_reduce", True) for c in rep.collectives), rep.collectives
        assert "stablehlo.all_gather" not in exported.mlir_module()
        out[f"cuda_{fmt}"] = {"moe_kernel_sites": len(moe), "all_reduces": len(rep.collectives)}
    return out


def test_sharded_moe_decode_equals_unsharded(report):
    out = run_json(__file__)
    report(f"routed MoE block on (data=2, model=2) == one device, per-format max_rel and the cuda export: {out}")


if __name__ == "__main__":
    print(json.dumps(check()))
