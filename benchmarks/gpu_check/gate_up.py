"""A quantized dense MLP's gate and up in one launch on the device (kernels_pallas/quant_gate_up.py,
`check_gate_up`): against the reference (quant_matmul_reference twice, the activation between) and beside the
two launches of the decode kernel (quant_gemv's at 1 - 3 rows, the tensor-core kernels' at a verify's 4) and
XLA's activation that the MLP ran before, in int4 groups, fp8 blocks and int8 per channel, at small shapes and
at Qwen3.5-27B's gate / up (5120 x 17408), 35B-A3B's shared expert (2048 x 512) and 27B's attention k / v
(5120 x 1024: the same launch, quant.pair_parts, hands its partials to kernels_pallas/attention_rows.py) at the
rows the one launch takes. GB/s counts the bytes both products must read (values, scales, x, the output); the
line gives both forms' times and their ratio: quant.GATE_UP_KINDS should follow it (the one launch saves a
kernel a layer; each of its programs is the single launch's, so the ratio is what the launch and the fusion
after it cost)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import quant_gate_up as gu
from kernels_pallas.quant_decode import decode_kernel

from .budget import out_of_time
from .common import case_label, compare_forms, one_line, timed_forms
from .quant import _quant_inputs
from .timing import time_call

# (kind, "channel" | int4 group | fp8 block, M, K, N, x dtype)
GATE_UP_SMOKE = [("int4", 32, 1, 96, 40, "float32")]
GATE_UP_SMALL = GATE_UP_SMOKE + [("int8", "channel", 2, 200, 72, "bfloat16"),
                                 ("fp8", (128, 128), 3, 300, 136, "float32"), ("int4", 128, 1, 300, 136, "bfloat16"),
                                 ("int4", 32, 4, 256, 64, "bfloat16"), ("int8", "channel", 5, 200, 72, "bfloat16"),
                                 ("fp8", (128, 128), 4, 300, 136, "bfloat16")]
# at 1 / 3 rows the FMA kernel's pair form, at 4 (a k = 3 verify) the tensor-core kernels'

GATE_UP_REAL = [(kind, fmt, M, K, N, "bfloat16") for (K, N) in ((5120, 17408), (2048, 512), (5120, 1024))
                for kind, fmt, M in (("int4", 128, 1), ("fp8", (128, 128), 1), ("int8", "channel", 1),
                                     ("fp8", (128, 128), 3), ("int4", 128, 4), ("int8", "channel", 4),
                                     ("fp8", (128, 128), 4))]
HBM_TARGET = 0.8
NAMES = ("one launch", "two launches", "one/two")


def _two_launches(kernel, kind, K, block, interpret):
    """The MLP's form before quant_gate_up.py: gate and up each on the decode kernel (quant_decode.decode_kernel's
    choice), silu(g) * u in XLA."""
    call = functools.partial(kernel, kind=kind, k=K, block=block, backend="pallas", interpret=interpret)
    return jax.jit(lambda x, qg, sg, qu, su: jax.nn.silu(call(x, qg, sg)) * call(x, qu, su))


def check_gate_up(cases, interpret, timings):
    """Each case: the one launch and the two launches against the reference; with timings, both timed."""
    failures = 0
    for i, (kind, fmt, M, K, N, dtype) in enumerate(cases):
        label = case_label(f"dense gate / up in one launch {kind} {fmt} M{M} K{K} N{N} {dtype}")
        if out_of_time(f"{label} and the rest"):
            break
        try:
            x, qg, sg, block = _quant_inputs(kind, fmt, M, K, N, jnp.dtype(dtype), 700 + i)
            _, qu, su, _ = _quant_inputs(kind, fmt, M, K, N, jnp.dtype(dtype), 800 + i)
            args = (x, qg, sg, qu, su)
            kw = dict(kind=kind, k=K, block=block)
            reason = gu.unsupported_reason(*args, **kw)
            assert reason is None, reason
            one = jax.jit(functools.partial(gu.quant_gate_up_pallas, **kw, interpret=interpret))
            two = _two_launches(decode_kernel(x, qg, sg, kind, K, block), kind, K, block, interpret)
            want = np.asarray(jax.jit(functools.partial(gu.quant_gate_up_reference, **kw))(*args), np.float32)
            got = np.asarray(one(*args).astype(jnp.float32))
            got2 = np.asarray(two(*args).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok, line = compare_forms(label, NAMES, dtype, want, got, got2)
        failures += not ok
        if timings:
            nbytes = sum(a.nbytes for a in (qg, sg, qu, su)) + x.nbytes + M * N * x.dtype.itemsize
            line += timed_forms(NAMES, nbytes, time_call(one, *args), time_call(two, *args), HBM_TARGET)
        print(line, flush=True)
        del args
    return failures
