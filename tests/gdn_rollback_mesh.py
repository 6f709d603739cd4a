"""A GDN layer's rollback under a mesh (kernels_pallas/per_shard.py `rollback_rows`), on (data=2, model=2) over 4
virtual CPU devices, in a process of its own (the devices must be set before jax starts): run by
tests/test_kernel_gdn_rollback.py. Prints one JSON line: the sharded kernel (interpret mode) against the unsharded
reference, and what the program lowered for cuda under the mesh holds (the kernel per shard, on local rows,
channels and heads)."""

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check() -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels_pallas import per_shard
    from kernels_pallas.gdn_rollback import gdn_rollback, gdn_rollback_reference
    from qwen_mtp.parallel import sharding
    from qwen_mtp.tools.lowering import export_for, local_kernel_operands

    mesh = sharding.make_mesh(2, 2)
    B, K, C, h, d, T = 4, 4, 640, 4, 16, 4
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    G = -jnp.cumsum(0.5 * jnp.abs(f(B, h, T)), axis=-1)
    host = (f(B, K - 1, C), f(B, T, C), f(B, h, d, d), G, f(B, h, T, d), f(B, h, T, d),
            jnp.array([0, 3, 1, 2], jnp.int32))
    specs = (P("data", None, "model"), P("data", None, "model"), P("data", "model", None, None),
             P("data", "model", None), P("data", "model", None, None), P("data", "model", None, None), P("data"))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(host, specs)]
    call = functools.partial(gdn_rollback, backend="pallas", interpret=True)
    want_conv, want_rec = gdn_rollback_reference(*host)
    with jax.set_mesh(mesh):
        conv, rec = jax.jit(lambda *a: per_shard.rollback_rows(call, *a))(*args)
    err = float(jnp.max(jnp.abs(rec - want_rec)) / jnp.max(jnp.abs(want_rec)))
    assert err < 1e-6 and bool((conv == want_conv).all()), err
    sds = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if i < 2 else a.dtype, sharding=a.sharding)
           for i, a in enumerate(args)]
    with jax.set_mesh(mesh):
        exported = export_for(lambda *a: per_shard.rollback_rows(gdn_rollback, *a), *sds, platform="cuda")
    operands = local_kernel_operands(exported, "gdn_rollback")  # one kernel, per shard, no collective
    # local rows (2), channels (320) and heads (2)
    assert {"tensor<2x3x320xbf16>", "tensor<2x4x320xbf16>", "tensor<2x2x16x16xf32>"} <= operands, operands
    return {"max_rel": err, "operands": sorted(operands)}


if __name__ == "__main__":
    print(json.dumps(check()))
