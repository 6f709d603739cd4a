"""Item 6: tensor parallel over every visible device (mesh data=1, model=n): the same greedy tokens on n devices as
on one (f32, plain and windowed speculative), then the bf16 decode step time on 1 device and on n."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from .models import TP_SMALL, random_model

# tensor parallel (item 6): the model on one device and on a mesh (data=1, model=n) over every visible device
TP_SPECS = {"plain": None, "windowed k3 W64 S4": {"k": 3, "window": 64, "sinks": 4}}


def _as_bf16(model):
    """The same model with its unquantized arrays in bf16 (activations follow them); QuantArrays as they are."""
    import dataclasses

    from qwen_mtp.trunk import quant

    cast = lambda x: x if isinstance(x, quant.QuantArray) else x.astype(jnp.bfloat16)
    weights = jax.tree.map(cast, model.weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
    return dataclasses.replace(model, weights=weights, dtype="bfloat16")


def check_tensor_parallel(max_new):
    """Item 6: tokens on n devices = tokens on one; decode step time 1 device vs n. 0 failures when skipped."""
    import qwen_mtp
    from qwen_mtp.parallel.sharding import make_mesh
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.config import parse_config

    devices, backend = jax.devices(), jax.default_backend()
    n = len(devices)
    if n < 2:
        why = ("1 GPU visible; it needs 2 or more" if backend == "gpu" else
               f"no GPU and 1 {backend} device; it needs 2 or more devices (on CPU, "
               "XLA_FLAGS=--xla_force_host_platform_device_count=2 runs it on a small config)")
        print(f"tensor parallel: skipped, {why}", flush=True)
        return 0
    on_gpu = backend == "gpu"
    if on_gpu:
        name, cfg = "Qwen3.5-27B slice, 4 layers", real_shapes.config("Qwen3.5-27B", layers=4)
    else:
        name, cfg = "small config", parse_config(TP_SMALL, "<gpu_check small config>")
    t = time.perf_counter()
    one = random_model(cfg, name)
    mesh = make_mesh(data=1, model=n)
    sharded = qwen_mtp.shard(one, mesh)
    jax.block_until_ready((one.weights, sharded.weights))
    print(f"tensor parallel, {name}, int4 g128 weights (lm_head and MTP head too), over {n} {backend} devices "
          f"(built in {time.perf_counter() - t:.1f} s):", flush=True)
    print("  " + sharded.describe_sharding().replace("\n", "\n  "), flush=True)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 64)
    specs = {label: None if kw is None else qwen_mtp.SpecConfig(**kw) for label, kw in TP_SPECS.items()}
    failures = 0

    def run(model, spec, timed):
        r = qwen_mtp.generate(model, ids, max_new, spec=spec, eos_token_id=[])
        if timed:  # the first call compiled
            r = qwen_mtp.generate(model, ids, max_new, spec=spec, eos_token_id=[])
        return r

    with jax.default_matmul_precision("highest"):  # f32 dots in f32 (not TF32): only the summation order differs
        base = run(one, None, False).tokens[0]
        for label, spec in specs.items():
            got = {"1 device": base if spec is None else run(one, spec, False).tokens[0],
                   f"{n} devices": run(sharded, spec, False).tokens[0]}
            for where, tokens in got.items():
                same = int(np.sum(tokens == base))
                ok = np.array_equal(tokens, base)
                failures += not ok
                print(f"  f32 {label:20s} on {where:10s}: {same}/{len(base)} tokens = 1-device plain greedy "
                      f"{'OK' if ok else 'FAIL'}", flush=True)
    one_b = _as_bf16(one)
    del one, sharded  # the f32 copies
    sharded_b = qwen_mtp.shard(one_b, mesh)
    for label, spec in specs.items():
        r1, rn = run(one_b, spec, True), run(sharded_b, spec, True)
        same = int(np.sum(r1.tokens[0] == rn.tokens[0]))
        al = f", AL {r1.stats.acceptance_length:.2f} / {rn.stats.acceptance_length:.2f}" if spec else ""
        print(f"  bf16 {label:20s} TPOT 1 device {1e3 * r1.stats.tpot_s:.2f} ms, {n} devices "
              f"{1e3 * rn.stats.tpot_s:.2f} ms: 1 device / {n} = {r1.stats.tpot_s / rn.stats.tpot_s:.2f}x "
              f"({same}/{len(r1.tokens[0])} tokens equal, not checked in bf16{al})", flush=True)
    return failures
