"""The GDN conv step under a mesh (kernels_pallas/per_shard.py `conv_rows`), on (data=2, model=2) over 4 virtual
CPU devices, in a process of its own (the devices must be set before jax starts): run by
tests/test_kernel_gdn_conv.py. Prints one JSON line: the sharded kernel (interpret mode) against the unsharded
reference, and what the program lowered for cuda under the mesh holds (the kernel per shard, on local channels)."""

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
    from kernels_pallas.gdn_conv import conv_step, conv_step_reference
    from qwen_mtp.parallel import sharding
    from qwen_mtp.tools.lowering import export_for, local_kernel_operands

    mesh = sharding.make_mesh(2, 2)
    B, C, K = 4, 640, 4
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x, state, w, valid = f(B, C), f(B, K - 1, C), f(K, C), jnp.array([True, False, True, True])
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (place(x, P("data", "model")), place(state, P("data", None, "model")), place(w, P(None, "model")),
            place(valid, P("data")))
    call = functools.partial(conv_step, backend="pallas", interpret=True)
    with jax.set_mesh(mesh):
        out, new = jax.jit(lambda *a: per_shard.conv_rows(call, *a))(*args)
    want, want_new = conv_step_reference(x, state, w, valid)
    err = float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-6 and bool((new == want_new).all()), err
    sds = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if a.dtype == jnp.float32 else a.dtype, sharding=a.sharding)
           for a in args]
    with jax.set_mesh(mesh):
        exported = export_for(lambda *a: per_shard.conv_rows(conv_step, *a), *sds, platform="cuda")
    operands = local_kernel_operands(exported, "gdn_conv_step")  # one kernel, per shard, no collective
    assert "tensor<2x320xbf16>" in operands and "tensor<2x3x320xbf16>" in operands, operands  # local rows, channels
    return {"max_rel": err, "operands": sorted(operands)}


if __name__ == "__main__":
    print(json.dumps(check()))
