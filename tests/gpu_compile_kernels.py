"""Every Pallas kernel family at real Qwen3.5 shapes, compiled for an H200 by XLA's own GPU compiler on this CPU
(qwen_mtp.tools.gpu_compile): run by tests/test_gpu_compile.py in the environment that has jax's CUDA plugin
(`python tests/gpu_compile_kernels.py`, from the repository). The shapes and argument builders are the cuda
export tests' (test_export_cuda.py, test_moe_routed.py), which prove the same programs lower; this proves XLA
compiles them, each Triton kernel through XLA's Triton and ptxas. One JSON line per case: its label, the Pallas
kernels found in the compiled program (by name), the seconds, or the error. With --loops: the decode loops'
weight concatenations instead (`loops`); with --mesh: a tensor-parallel round's collectives (`mesh`); with --trees:
the tree loop's CUDA graphs (`trees`)."""

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # gpu_scale (launches, programs)

from qwen_mtp.tools import gpu_compile  # noqa: E402

gpu_compile.prepare()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def cases():
    """(label, jitted fn, args, static kwargs, the kernel names the program must hold)."""
    from kernels_pallas.causal_attention import causal_attend
    from kernels_pallas.windowed_attention import windowed_attend, windowed_attend_pallas
    from qwen_mtp.trunk import mlp
    from tests.test_export_cuda import QUANT_REAL, REAL_HEADS, _causal_args, _kernel_args, _quant_args, _quant_fn
    from tests.test_moe_routed import _expert_kernels, _moe_shapes

    out = []
    for kind in ("int8", "int4", "fp8"):  # backend auto: the FMA decode kernel at 1 row, the tensor-core one at 5
        for name, (K, N) in QUANT_REAL.items():
            for M, suffix in ((1, ""), (5, "_mma")):
                args, block = _quant_args(kind, M, K, N, jnp.bfloat16)
                out.append((f"quant {kind} {name} M{M}", _quant_fn(kind, K, block), args, {},
                            {f"quant_matmul_{kind}{suffix}": 1}))
    args, block = _quant_args("fp8", 5, 5120, 17408, jnp.bfloat16, fmt="channel")
    out.append(("quant fp8 per channel gate/up M5", _quant_fn("fp8", 5120, block), args, {},
                {"quant_matmul_fp8_mma": 1}))
    from kernels_pallas.quant_gate_up import quant_gate_up
    for kind in ("int8", "int4", "fp8"):  # a dense MLP's gate and up in one launch (quant_gate_up.py), 27B, 1 row
        (x, q, s), block = _quant_args(kind, 1, 5120, 17408, jnp.bfloat16)
        fn = jax.jit(lambda *a, kind=kind, block=block: quant_gate_up(*a, kind=kind, k=5120, block=block))
        out.append((f"quant gate/up in one launch {kind} 27B M1", fn, (x, q, s, q, s), {},
                    {f"quant_gate_up_{kind}": 1}))
    for kind in ("int4", "int8", "fp8"):  # ... and at a k = 3 verify's 4 rows, the tensor-core kernels' pair form
        (x, q, s), block = _quant_args(kind, 4, 5120, 17408, jnp.bfloat16)
        fn = jax.jit(lambda *a, kind=kind, block=block: quant_gate_up(*a, kind=kind, k=5120, block=block))
        out.append((f"quant gate/up in one launch {kind} 27B M4 (tensor cores)", fn, (x, q, s, q, s), {},
                    {f"quant_gate_up_{kind}_mma": 1}))
    moe = jax.jit(mlp.moe, static_argnums=2)
    for name, quant, tokens in (("Qwen3.5-35B-A3B", None, 1), ("Qwen3.5-35B-A3B", "int8", 1),
                                ("Qwen3.5-35B-A3B", "int4", 1), ("Qwen3.5-35B-A3B", "fp8", 1),
                                ("Qwen3.5-35B-A3B", "int4", 8), ("Qwen3.5-397B-A17B", None, 1)):
        cfg, args = _moe_shapes(name, quant, tokens)
        out.append((f"moe {name} {quant or 'bf16'} {tokens} token(s)", moe, (*args, cfg), {},
                    {**dict.fromkeys(_expert_kernels(quant), 1), "moe_router_topk": 1}))  # experts, top-k
    for model, (nh, nkv) in REAL_HEADS.items():  # a draft step at W 4032 S 64; the k = 8 refill at B 8, W 8192
        for B, T, W, S in ((1, 1, 4032, 64), (8, 9, 8192, 128)):
            args = _kernel_args(B, T, nh, nkv, 256, S + W + max(T - 1, 1), jnp.bfloat16)
            fn = jax.jit(lambda *a, W=W, S=S: windowed_attend(*a, W, S))
            out.append((f"windowed attention {model} B{B} T{T} W{W} S{S}", fn, args, {},
                        {"windowed_draft_attention": 1}))
    for b, t, S, kv in ((1, 256, 131072, None), (1, 1, 1 << 20, None), (8, 9, 131072, None),
                        (1, 9, 131072, jnp.float8_e4m3fn)):
        args = _causal_args(b, t, 24, 4, 256, S, jnp.bfloat16, kv)
        label = f"causal attention 27B B{b} T{t} S{S}" + (" fp8 cache" if kv else "")
        out.append((label, jax.jit(causal_attend), args, {}, {"causal_attention": 1}))
    from kernels_pallas.attention_rows import attend_new_rows
    S_, f32, bf16 = jax.ShapeDtypeStruct, jnp.float32, jnp.bfloat16
    for model, B, T, Sq, Skv, kv in (("27B", 1, 1, 14, 14, bf16), ("27B", 1, 4, 8, 14, jnp.float8_e4m3fn),
                                     ("35B-A3B", 8, 1, 4, 4, bf16)):  # a decode step, a k = 3 verify, a batch
        nh, nkv = REAL_HEADS[model]
        cache = S_((B, 131072, nkv, 256), kv)
        args = (S_((Sq, B * T, nh * 512), f32), S_((256,), bf16), S_((Skv, 2, B * T, nkv * 256), f32), S_((256,), bf16),
                cache, cache, S_((B,), jnp.int32))
        fn = jax.jit(lambda *a: attend_new_rows(*a, rope_offset=0, head_dim=256, rotary_dim=64, theta=1e7, eps=1e-6,
                                                dtype=bf16))
        out.append((f"attention new rows {model} B{B} T{T} S131072" + (" fp8 cache" if kv != bf16 else ""), fn, args,
                    {}, {"attention_new_rows": 1, "causal_attention": 1}))
    from kernels_pallas.quant_gate_up import quant_pair_parts
    for M, suffix in ((1, ""), (4, "_mma")):  # 27B's k and v in one launch (quant.pair_parts), a step and a verify
        (x, q, s), block = _quant_args("int4", M, 5120, 1024, jnp.bfloat16)
        fn = jax.jit(lambda *a, block=block: quant_pair_parts(*a, kind="int4", k=5120, block=block, name="k_v"))
        out.append((f"quant k / v in one launch int4 27B M{M}", fn, (x, q, s, q, s), {},
                    {f"quant_k_v_int4{suffix}": 1}))
    from kernels_pallas.add_rmsnorm import add_rmsnorm_rows
    for model, R, S, H, pad in (("27B", 1, 16, 5120, False), ("27B", 4, 8, 5120, False), ("35B-A3B", 1, 4, 2048, True)):
        args = (S_((R, H), bf16), S_((S, R, H), f32), S_((H,), bf16))  # a step's and a verify's out_proj partials
        fn = jax.jit(lambda *a, pad=pad: add_rmsnorm_rows(*a, eps=1e-6, pad_row=pad))
        out.append((f"residual add + RMSNorm {model} R{R} H{H} from {S} K partials" + (" pad_row" if pad else ""),
                    fn, args, {}, {"add_rmsnorm_rows": 1}))
    from kernels_pallas.moe_add_rmsnorm import moe_add_rmsnorm_rows
    gate = (S_((1, 1), f32), S_((2, 2048), bf16), S_((2048, 1), bf16))  # 35B-A3B: the shared gate's logit, rows, weight
    args = (S_((1, 2048), bf16), S_((2, 9, 2048), f32), S_((1, 8), f32), gate, S_((2048,), bf16))
    fn = jax.jit(lambda *a: moe_add_rmsnorm_rows(*a, eps=1e-6, norm_topk=True, pad_row=True))
    out.append(("MoE combine + residual add + RMSNorm 35B-A3B k8 from 2 K partials pad_row", fn, args, {},
                {"moe_add_rmsnorm_rows": 1}))
    from kernels_pallas.gdn_rollback import gdn_rollback
    from kernels_pallas.gdn_step import gdn_step
    from kernels_pallas.gdn_verify import gdn_verify
    from tests.test_kernel_gdn_rollback import REAL_GDN as ROLLBACK_GDN
    for model, B, parts in (("27B", 1, 0), ("27B", 1, 8), ("35B-A3B", 8, 0)):  # a k = 3 round's rollback, in place
        C, h = ROLLBACK_GDN[model]
        S, f32, bf16 = jax.ShapeDtypeStruct, jnp.float32, jnp.bfloat16
        x = S((parts, B, 4, C), f32) if parts else S((B, 4, C), bf16)
        args = (S((B, 3, C), bf16), x, S((B, h, 128, 128), f32), S((B, h, 4), f32), S((B, h, 4, 128), f32),
                S((B, h, 4, 128), f32), S((B,), jnp.int32))
        out.append((f"GDN rollback {model} B{B} T4" + (f" from {parts} K partials" if parts else ""),
                    jax.jit(gdn_rollback), args, {}, {"gdn_rollback": 1}))
    from tests.test_kernel_gdn_step import REAL_GDN, _real_args
    for model, B, T in (("27B", 1, None), ("27B", 8, None), ("27B", 1, 4), ("122B-A10B / 397B-A17B", 8, 9)):
        nk, nv = REAL_GDN[model]
        fn = gdn_step if T is None else gdn_verify
        out.append((f"GDN {'step' if T is None else f'verify T{T}'} {model} B{B}",
                    jax.jit(lambda *a, fn=fn, nk=nk: fn(*a, num_k_heads=nk, eps=1e-6)), _real_args(B, nk, nv,
                    jnp.bfloat16, T), {}, {"gdn_decode_step" if T is None else "gdn_verify": 1}))
    nk, nv = REAL_GDN["27B"]  # the step's z as its K partials (27B int4's z: 14 parts), summed by the kernel
    args = _real_args(1, nk, nv, jnp.bfloat16, None)
    args = (args[0], jax.ShapeDtypeStruct((14, *args[1].shape), jnp.float32), *args[2:])
    out.append(("GDN step 27B B1, z from its K partials", jax.jit(lambda *a: gdn_step(*a, num_k_heads=nk, eps=1e-6)),
                args, {}, {"gdn_decode_step": 1}))
    from kernels_pallas.gdn_conv import conv_step
    from tests.test_kernel_gdn_conv import REAL_CONV
    S = jax.ShapeDtypeStruct
    for model, B in (("27B", 1), ("122B-A10B / 397B-A17B", 8)):
        C = REAL_CONV[model]
        args = (S((B, C), jnp.bfloat16), S((B, 3, C), jnp.bfloat16), S((4, C), jnp.float32), S((B,), jnp.bool_))
        out.append((f"GDN conv step {model} B{B}", jax.jit(conv_step), args, {}, {"gdn_conv_step": 1}))
    C = REAL_CONV["27B"]  # the row as its K partials (27B int4's qkv: 14 parts), summed by the kernel
    args = (S((14, 1, C), jnp.float32), S((1, 3, C), jnp.bfloat16), S((4, C), jnp.float32), S((1,), jnp.bool_))
    out.append(("GDN conv step 27B B1, the row from its K partials", jax.jit(conv_step), args, {},
                {"gdn_conv_step": 1}))
    from kernels_pallas.moe_router import router_topk
    from tests.test_kernel_moe_router import REAL_ROUTERS
    for model, n in (("35B-A3B / 122B-A10B", 1), ("397B-A17B", 8)):
        E, k = REAL_ROUTERS[model]
        out.append((f"MoE router top-k {model} n{n}", jax.jit(lambda p, k=k: router_topk(p, k=k)),
                    (S((n, E), jnp.float32),), {}, {"moe_router_topk": 1}))
    from kernels_pallas.rmsnorm import rmsnorm_rows
    from tests.test_kernel_rmsnorm import REAL_HIDDEN
    for model in ("27B", "397B-A17B"):
        H = REAL_HIDDEN[model]
        out.append((f"RMSNorm row {model} H{H}", jax.jit(lambda x, w: rmsnorm_rows(x, w, eps=1e-6)),
                    (S((1, 1, H), jnp.bfloat16), S((H,), jnp.bfloat16)), {}, {"rmsnorm_rows": 1}))
    # a launch the rules never pick (K / V blocks of 128 slots, 3 stages: over one block's shared memory): XLA
    # must refuse it, or the compile is not reaching the kernels' machine code (want None: an error)
    args = _kernel_args(1, 1, 24, 4, 256, 64 + 4032 + 1, jnp.bfloat16)
    fn = jax.jit(lambda *a: windowed_attend_pallas(*a, 4032, 64, block_k=128, num_stages=3))
    out.append(("windowed attention 27B draft step, K / V blocks of 128 at 3 stages (too big)", fn, args, {}, None))
    return out


def loops(target):
    """--loops: the k = 1 native round of 4 real-width layers (3 GDN, 1 attention) of 27B and 35B-A3B in bf16,
    compiled for `target`: the concatenations of 4 MB or more inside the loop (benchmarks/gpu_scale/launches.py)
    and of 512 KB or more (small_concatenations)
    and the products of 1 MB or more written out (launches.products), and the kernels an iteration; 35B-A3B's
    plain step, and again without ops.VECTOR_DOT_MAX's two rows; then 27B's round with the GDN verify in XLA ops
    (its reference, as before kernels_pallas/gdn_verify.py's kernel); 35B-A3B's plain step with the router's top-k
    by lax.top_k, with gate / up on copies of each token's row and with the experts' SwiGLU in three calls, as
    before moe_router.py, moe_gemv's rows_per_x and moe_expert_mlp.py, with out_proj's input padded by XLA after
    the GDN step kernel (before its pad_row) and with its input norms' two rows made by XLA after the norm's
    kernel (before rmsnorm's pad_row), and in int4 with and without them, and with the shared expert's products
    apart from the routed experts' launches (before mlp._routed_and_shared), bf16 and int4, and with the MoE
    block's combine and add apart from the next norm (before moe_add_rmsnorm.py), int4 and bf16; 27B's plain step, and
    with its input and final norms in XLA ops (before rmsnorm.py's kernel), and with its attention's new rows in
    XLA ops (before attention_rows.py's kernel), and so again with its KV rows written by the batched scatter
    (before attention.ONE_ROW_WRITE); 27B int4's plain step, and with its residual add and post norm apart
    (before add_rmsnorm.py), with its MLPs' add apart from the next norm (before forward.HAND_ON), with its MLPs'
    gate and up in two launches (before quant_gate_up.py), with its MLPs' add apart and K's parts summed by one
    reduce (before split_k.sum_parts), and
    with the GDN qkv / z products' K parts summed by XLA (before gdn.step_projections), and with its attention's
    new rows in XLA ops (before attention_q.py's and attention_rows.py's kernels); 27B int4's k = 1 round, and
    with the verify's z K parts summed by XLA (before the GDN verify kernel took them), with its gate and up in
    two launches (before quant_mma's pair form), and with b and a as products (before gdn.gate_products'
    partials); 27B int4's plain step at batch 4, and with the tensor-core kernel's K parts
    summed by XLA (before quant_decode.decode_parts took them); 27B int4's k = 1 round and 27B's k = 3 round,
    and each with the rollback in XLA ops (before gdn_rollback.py's kernel); 27B's round with b and
    a on one x (merged over their weights concatenated in the loop, before in_projections' copies); and 27B's
    round with the GDN in-projections as they were before gdn.in_projections (four dots on one x), which XLA
    merged over the weights concatenated in the loop: the probe must find those."""
    import dataclasses
    import functools

    from gpu_scale import launches
    from gpu_scale.programs import Case, compile_case

    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk import gdn
    from qwen_mtp.trunk.ops import linear

    def one(label, name, k=1, quant=None, batch=1):
        cfg = real_shapes.config(name)
        cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:4])
        t = time.perf_counter()
        hlo = compile_case(cfg, "bfloat16", quant, Case(k), batch, 256, 64, target=target)[0].as_text()
        print(json.dumps({"label": label, "concatenations": launches.concatenations(hlo),
                          "small_concatenations": launches.concatenations(hlo, 1 << 19),
                          "products": launches.products(hlo), "kernels": launches.per_iteration(hlo).total(),
                          "seconds": time.perf_counter() - t}), flush=True)

    one("27B k1 native", "Qwen3.5-27B")
    one("35B-A3B k1 native", "Qwen3.5-35B-A3B")
    one("35B-A3B plain", "Qwen3.5-35B-A3B", k=0)
    from qwen_mtp.trunk import mlp, ops, quant

    # the MoE block as it was: the router's top-k by lax.top_k (XLA: a sort and a slice), and the routed gate / up
    # on k copies of each token's row (before moe_gemv's rows_per_x)
    router, routed_mlp, routed_and_shared = mlp.router_topk, mlp.routed_mlp, mlp._routed_and_shared
    mlp.router_topk = jax.lax.top_k
    jax.clear_caches()
    one("35B-A3B plain, the router's top-k by lax.top_k", "Qwen3.5-35B-A3B", k=0)
    mlp.router_topk = router
    mlp.routed_mlp = lambda x, g, u, d, ids, *, rows_per_x=1, **kw: routed_mlp(
        x[jax.numpy.arange(ids.shape[0]) // rows_per_x] if rows_per_x > 1 else x, g, u, d, ids, **kw)
    mlp._routed_and_shared = lambda *a, **kw: None  # (the routed experts' own launches: the shared expert apart)
    jax.clear_caches()
    one("35B-A3B plain, gate / up on copies of the row", "Qwen3.5-35B-A3B", k=0)
    mlp.routed_mlp = routed_mlp
    # the shared expert as one more pair a token in the routed experts' launches (mlp._routed_and_shared), against
    # its own products beside them
    jax.clear_caches()
    one("35B-A3B plain, the shared expert apart", "Qwen3.5-35B-A3B", k=0)
    jax.clear_caches()
    one("35B-A3B int4 plain, the shared expert apart", "Qwen3.5-35B-A3B", k=0, quant="int4")
    mlp._routed_and_shared = routed_and_shared
    # the routed experts' SwiGLU as three calls and XLA's activation between (before moe_expert_mlp.py)
    fused, quant.SWIGLU_KINDS = quant.SWIGLU_KINDS, ()
    jax.clear_caches()
    one("35B-A3B plain, the experts' SwiGLU in three calls", "Qwen3.5-35B-A3B", k=0)
    quant.SWIGLU_KINDS = fused
    # the GDN step kernel writing out_proj's two rows (pad_row), against XLA's pad after it
    pads, gdn.pads_one_row = gdn.pads_one_row, lambda w: False
    jax.clear_caches()
    one("35B-A3B plain, out_proj's input padded after the GDN step kernel", "Qwen3.5-35B-A3B", k=0)
    gdn.pads_one_row = pads
    # a layer's input norm writing the row's two rows (rmsnorm pad_row, forward.PADDED_INPUT), against XLA's pad
    from qwen_mtp.trunk import forward
    forward.PADDED_INPUT = False
    jax.clear_caches()
    one("35B-A3B plain, the input norm's two rows made by XLA", "Qwen3.5-35B-A3B", k=0)
    jax.clear_caches()  # and int4 experts: the post norm's kernel writing the router's two rows too
    one("35B-A3B int4 plain, the norms' two rows made by XLA", "Qwen3.5-35B-A3B", k=0, quant="int4")
    forward.PADDED_INPUT = True
    jax.clear_caches()
    one("35B-A3B int4 plain", "Qwen3.5-35B-A3B", k=0, quant="int4")
    # a MoE block's combine, the residual add and the next layer's input norm in one kernel at one row
    # (forward.HAND_ON, kernels_pallas/moe_add_rmsnorm.py), against the combine and the add apart from the norm
    forward.HAND_ON = False
    jax.clear_caches()
    one("35B-A3B int4 plain, the MoE block's add apart from the next norm", "Qwen3.5-35B-A3B", k=0, quant="int4")
    one("35B-A3B plain, the MoE block's add apart from the next norm", "Qwen3.5-35B-A3B", k=0)
    forward.HAND_ON = True
    # a layer's input norm and the final norm at one row as one kernel (ops.rmsnorm_written), against XLA's two
    one("27B plain", "Qwen3.5-27B", k=0)
    written = forward.rmsnorm_written
    forward.rmsnorm_written = lambda x, w, eps, pad_row=False: ops.rmsnorm_1pw(x, w, eps)
    forward.PADDED_INPUT = False  # (the norm's kernel's pad_row: XLA's norm has none)
    jax.clear_caches()
    one("27B plain, the input and final norms in XLA ops", "Qwen3.5-27B", k=0)
    forward.rmsnorm_written, forward.PADDED_INPUT = written, True
    # an attention layer's new rows by attention_rows.py's kernel (attention.QUERY_KERNEL), against XLA's: where
    # XLA writes them (a mesh, a prefill chunk), a batch of one row's KV cache written by its dynamic-update-slice
    # (attention.ONE_ROW_WRITE), against the batched scatter
    from qwen_mtp.trunk import attention
    attention.QUERY_KERNEL = False
    jax.clear_caches()
    one("27B plain, the attention's new rows in XLA ops", "Qwen3.5-27B", k=0)
    attention.ONE_ROW_WRITE = False
    jax.clear_caches()
    one("27B plain, XLA's KV rows written by a scatter", "Qwen3.5-27B", k=0)
    attention.ONE_ROW_WRITE, attention.QUERY_KERNEL = True, True
    # a quantized MLP's gate and up in one launch (quant_gate_up.py), against two (quant.GATE_UP_KINDS emptied)
    jax.clear_caches()
    one("27B int4 plain", "Qwen3.5-27B", k=0, quant="int4")
    # a layer's residual add after its mixer and its post norm in one kernel from the out-projection's partials
    # (forward.ADD_NORM, kernels_pallas/add_rmsnorm.py), against the add and the norm apart
    forward.ADD_NORM = False
    jax.clear_caches()
    one("27B int4 plain, the residual add and the post norm apart", "Qwen3.5-27B", k=0, quant="int4")
    forward.ADD_NORM = True
    # a dense MLP's residual add and the next layer's input norm (the final norm) in one kernel from the
    # down-projection's partials (forward.HAND_ON), against the add apart
    forward.HAND_ON = False
    jax.clear_caches()
    one("27B int4 plain, the MLP's add apart from the next norm", "Qwen3.5-27B", k=0, quant="int4")
    kinds, quant.GATE_UP_KINDS = quant.GATE_UP_KINDS, ()
    jax.clear_caches()
    one("27B int4 plain, gate and up in two launches", "Qwen3.5-27B", k=0, quant="int4")
    quant.GATE_UP_KINDS = kinds
    # where XLA adds the MLP's product (the MLP's add apart), K's partials summed in chunks XLA runs inside the
    # consumer (split_k.sum_parts), against one reduce of them all
    from kernels_pallas import split_k
    split_k.ELEMENTAL_ROWS = 1 << 20
    jax.clear_caches()
    one("27B int4 plain, the MLP's add apart, K's parts summed by one reduce", "Qwen3.5-27B", k=0, quant="int4")
    split_k.ELEMENTAL_ROWS, forward.HAND_ON = 31, True
    # the GDN qkv and z products' K partials summed by the conv and step kernels as they load them
    # (gdn.step_projections, quant.linear_parts), against XLA's sum of each before them
    linear_parts, gdn.linear_parts = gdn.linear_parts, lambda x, m: None
    jax.clear_caches()
    one("27B int4 plain, the GDN in-projections' K parts summed by XLA", "Qwen3.5-27B", k=0, quant="int4")
    # ... and a round's z partials (the tensor-core kernel's) summed by the GDN verify kernel (gdn.gdn_layer)
    jax.clear_caches()
    one("27B int4 k1 native, the verify's z K parts summed by XLA", "Qwen3.5-27B", quant="int4")
    gdn.linear_parts = linear_parts
    jax.clear_caches()
    one("27B int4 k1 native", "Qwen3.5-27B", quant="int4")
    # ... and its MLPs' gate and up in one tensor-core launch (quant_mma's pair form), against two
    kinds, quant.GATE_UP_KINDS = quant.GATE_UP_KINDS, ()
    jax.clear_caches()
    one("27B int4 k1 native, gate and up in two launches", "Qwen3.5-27B", quant="int4")
    quant.GATE_UP_KINDS = kinds
    # ... and b and a as their K partials summed by the verify kernel (gdn.gate_products), against the products
    gdn.GATE_PARTS = False
    jax.clear_caches()
    one("27B int4 k1 native, b and a as products", "Qwen3.5-27B", quant="int4")
    gdn.GATE_PARTS = True
    # a GDN layer's rollback as one kernel, both states in place (gdn_rollback.py), against its XLA reference (the
    # weights, the state's rebuild, the window's slice and its copy into the loop-carried conv state): int4 at
    # k = 1, bf16 at k = 3 (at k = 1 a bf16 round keeps the reference: rollback.KERNEL_MIN_ROWS)
    from qwen_mtp.decoding import rollback
    jax.clear_caches()
    one("27B k3 native", "Qwen3.5-27B", k=3)
    rebuild = rollback.gdn_rollback
    rollback.gdn_rollback = functools.partial(rebuild, backend="reference")
    jax.clear_caches()
    one("27B int4 k1 native, the rollback in XLA ops (its reference)", "Qwen3.5-27B", quant="int4")
    jax.clear_caches()
    one("27B k3 native, the rollback in XLA ops (its reference)", "Qwen3.5-27B", k=3)
    rollback.gdn_rollback = rebuild
    # the attention's new rows made by attention_rows.py's kernel from the products' partials, the queries with
    # their positions, the keys and values written into the caches (attention.QUERY_KERNEL), against XLA's kernels
    attention.QUERY_KERNEL = False
    jax.clear_caches()
    one("27B int4 plain, the attention's new rows in XLA ops", "Qwen3.5-27B", k=0, quant="int4")
    attention.QUERY_KERNEL = True
    # a batch of 4 (the tensor-core kernel's rows): its K partials summed by the GDN conv / step and the queries'
    # kernels (quant_decode.decode_parts), against XLA's sums (the FMA kernel's partials only, as before)
    from kernels_pallas import quant_decode
    jax.clear_caches()
    one("27B int4 plain batch 4", "Qwen3.5-27B", k=0, quant="int4", batch=4)
    parts = quant_decode.decode_parts
    quant_decode.decode_parts = lambda x, q, s, **kw: parts(x, q, s, **kw) if x.shape[0] == 1 else 1
    jax.clear_caches()
    one("27B int4 plain batch 4, the tensor-core kernel's K parts summed by XLA", "Qwen3.5-27B", k=0, quant="int4",
        batch=4)
    quant_decode.decode_parts = parts

    vector_max, ops.VECTOR_DOT_MAX = ops.VECTOR_DOT_MAX, 0
    jax.clear_caches()
    one("35B-A3B plain, one row through every weight (VECTOR_DOT_MAX 0)", "Qwen3.5-35B-A3B", k=0)
    ops.VECTOR_DOT_MAX = vector_max
    kernel = gdn.gdn_verify
    gdn.gdn_verify = functools.partial(kernel, backend="reference")
    jax.clear_caches()
    one("27B k1 native, the GDN verify in XLA ops (its reference)", "Qwen3.5-27B")
    gdn.gdn_verify = kernel
    in_projections = gdn.in_projections  # b and a over the round's rows on one x (before their copies): merged

    def ba_on_one_x(x, w, two=None, gate_parts=False):  # (b and a as their products)
        x_qkv, x_z, x_ba = jax.lax.optimization_barrier((x, x, x))
        return tuple(linear(v, m) for v, m in ((x_qkv, w.in_proj_qkv), (x_z, w.in_proj_z), (x_ba, w.in_proj_b),
                                                (x_ba, w.in_proj_a)))

    gdn.in_projections = ba_on_one_x
    jax.clear_caches()
    one("27B k1 native, b and a on one x", "Qwen3.5-27B")
    gdn.in_projections = in_projections
    gdn.in_projections = lambda x, w, two=None, gate_parts=False: tuple(
        linear(x, m) for m in (w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a))
    jax.clear_caches()  # the loop was traced with the fixed function
    one("27B k1 native, the in-projections on one x (before the fix)", "Qwen3.5-27B")


def mesh(target):
    """--mesh: the k = 3 round of 4 real-width 27B layers (bf16) tensor parallel over 8 compile-only GPUs
    (mesh data 1 x model 8, the shardings generate gives), compiled with the collectives XLA's partitioner
    writes: each collective in the loop with its bytes; then with the MTP head's embedding lookup left free, as
    before ops.embed_rows pinned its rows (the probe must find the table's all-to-all)."""
    import dataclasses

    import numpy as np

    from gpu_scale import launches

    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.decoding.speculative import SpecConfig, spec_decode
    from qwen_mtp.head import mtp
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.tools.lowering import spec_decode_args

    grid = jax.sharding.Mesh(np.array(gpu_compile.devices(target, 8)).reshape(1, 8), ("data", "model"))
    cfg = real_shapes.config("Qwen3.5-27B")
    cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:4])
    spec, sampling = SpecConfig(k=3), Sampling()

    def one(label):
        t = time.perf_counter()
        args = spec_decode_args(cfg, jnp.bfloat16, spec, batch=1, cache_len=4096, cap=64, mesh=grid,
                                sampling=sampling)
        with jax.set_mesh(grid):
            hlo = spec_decode.trace(args[0], cfg, *args[1:], spec=spec, sampling=sampling).lower().compile().as_text()
        print(json.dumps({"label": label, "collectives": launches.collectives(hlo),
                          "seconds": time.perf_counter() - t}), flush=True)

    one("27B k3 native, model 8")
    fixed = mtp.embed_rows

    def free(embed, tokens):  # ops.embed_rows without its sharding constraint
        embed, tokens = jax.lax.optimization_barrier((embed, tokens))
        return embed[tokens]

    mtp.embed_rows = free
    jax.clear_caches()
    one("27B k3 native, model 8, the head's embedding rows left free (before the fix)")
    mtp.embed_rows = fixed


def trees(target):
    """--trees: the tree loop (tree_loop.tree_decode) of a tiny 35B-A3B-shaped config (gpu_scale's short form),
    a sampled static tree and a greedy dynamic one, compiled for `target`: what XLA records as CUDA graphs
    (gpu_scale/graphs.py, from its thunk dump). Before tree_draft joined its levels, the sampled static tree's two
    token writes were copies that split a round into 3 graphs."""
    from gpu_scale import graphs
    from gpu_scale.models import RUNS, config

    from qwen_mtp.decoding import tree_loop
    from qwen_mtp.decoding.generate import EOS_SLOTS
    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.decoding.speculative import SpecConfig
    from qwen_mtp.head.tree import DynamicTree, StaticTree
    from tests.test_tree import tree_args

    cfg = config(RUNS["35B-A3B-bf16"][0], True, 256)
    for label, spec, sampling in (
            ("sampled static tree (2, 2, 1)", SpecConfig(k=3, tree=StaticTree((2, 2, 1))),
             Sampling(temperature=0.7, top_k=50)),
            ("greedy dynamic tree", SpecConfig(k=3, tree=DynamicTree(depth=3, topk=2, budget=8)), Sampling())):
        t = time.perf_counter()
        w, *rest = gpu_compile.place(tree_args(cfg, jnp.bfloat16, spec, B=1, cache=256, cap=32, n_eos=EOS_SLOTS),
                                     target)
        lowered = tree_loop.tree_decode.trace(w, cfg, *rest, spec=spec, sampling=sampling).lower()
        print(json.dumps({"label": label, "graphs": graphs.compile_dumped(lowered)[1],
                          "seconds": time.perf_counter() - t}), flush=True)


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "H200"
    if "--loops" in sys.argv:
        return loops(target)
    if "--trees" in sys.argv:
        return trees(target)
    if "--mesh" in sys.argv:
        return mesh(target)
    for label, fn, args, static, want in cases():
        t = time.perf_counter()
        try:
            hlo = gpu_compile.compile_for(fn, *args, target=target, **static).as_text()
            got = dict(gpu_compile.pallas_kernels(hlo))
            print(json.dumps({"label": label, "kernels": got, "want": want, "seconds": time.perf_counter() - t}),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report every case
            print(json.dumps({"label": label, "error": f"{type(e).__name__}: {str(e)[:500]}"}), flush=True)


if __name__ == "__main__":
    main()
