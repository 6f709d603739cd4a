"""--compile-for H200 (or H100): every program of the run compiled for a GPU this machine need not have, by XLA's
own GPU compiler run deviceless (qwen_mtp.tools.gpu_compile), at full depth, nothing run. Per program: the
compile seconds on this host, the kernels one step / round launches in the program a GPU would run (launches.py),
the Pallas kernels among them, the device memory it asks for beyond its arguments (XLA's temp buffers), and the
concatenations of 4 MB or more inside its loop (launches.concatenations: a weight copied at every step) and the
weight-sized products it writes out (launches.products: a dot split into a multiply and a reduce), and what XLA
recorded as CUDA graphs (graphs.py: from the thunk sequence it dumps; with --loop-graph, also the plain step and
the first native round compiled with the whole loop one graph). Per model: the bytes a plain step reads, their
time at the target's peak bandwidth, and what is left per kernel for launch and tail time if the step is to read
at 85% of the peak (issue 38's 27B target): a launch budget, the figure a GPU run's kernel time per launch
(report.py) is read against. No time is measured here."""

import time

from . import graphs, launches
from .models import RUNS, abstract_weights, config
from .programs import lower_case
from .reads import step_reads, weight_parts
from .report import gb

TARGET_SHARE = 0.85  # the share of the HBM peak the launch budget is computed for


def launch_budget_us(step_bytes, bw, kernels, share=TARGET_SHARE):
    """Microseconds per kernel a step may spend beyond its bytes' time at peak and still read at `share` of it."""
    bytes_s = step_bytes / bw
    return 1e6 * (bytes_s / share - bytes_s) / max(kernels, 1)


def run(a, p, budget, cases):
    """Compile each case of each run for a.compile_for; print as they end. Returns the number of failures."""
    from qwen_mtp.tools import gpu_compile

    target = a.compile_for
    bw = gpu_compile.TARGETS[target]["memory_bandwidth"]
    ks = max(a.ks)
    ctx = a.ctxs[0]
    cap_plain, cap_spec = p["steps"] + 4, (p["rounds"] + 2) * (ks + 1) + 8
    slots = ctx + cap_spec + 8
    print(f"gpu_scale --compile-for {target}: XLA's GPU compiler on this host, deviceless (sm_90, "
          f"{bw / 1e12:.2f} TB/s peak taken for the bytes' time), batch 1, bf16 activations, caches of {slots} "
          "positions; nothing runs", flush=True)
    import jax.numpy as jnp

    from . import launch_probe

    probe = gpu_compile.compile_for(launch_probe.program(), jnp.zeros((launch_probe.SIZE,), jnp.float32),
                                    jnp.int32(1), target=target)
    print(f"launch probe (launch_probe.py) compiled for {target}: "
          f"{launches.describe(launches.per_iteration(probe.as_text()))} an iteration", flush=True)
    runs = a.runs.split(",")
    failures = 0
    for i, name in enumerate(runs):
        real, quant = RUNS[name]
        cfg = config(real, a.short, slots)
        parts = weight_parts(abstract_weights(cfg, "bfloat16", quant), cfg)
        reads = step_reads(parts, cfg, 1, ctx, 2)
        step_bytes = sum(reads.values())
        print(f"== {name}: {cfg.num_layers} layers + MTP head; a plain step at {ctx} positions reads "
              f"{gb(step_bytes)} = {1e6 * step_bytes / bw:.1f} us at the peak", flush=True)
        share_end = time.perf_counter() + max(0.0, budget.left()) / (len(runs) - i)
        est = 0.0
        for case in cases:
            if not budget.fits(f"{name} {case.label}", share_end, est):
                continue
            try:
                lowered, secs = lower_case(cfg, "bfloat16", quant, case, 1, slots,
                                           cap_plain if not case.k else cap_spec, target=target)
                t = time.perf_counter()
                compiled, where = graphs.compile_dumped(lowered)
                secs += time.perf_counter() - t
                est = max(est, secs)
                hlo = compiled.as_text()
                kernels = launches.per_iteration(hlo)
                pallas = gpu_compile.pallas_kernels(hlo)
                temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0)
                cats, prods = launches.concatenations(hlo), launches.products(hlo)
                cat = "none" if not cats else f"{len(cats)}, {gb(sum(b for _, b in cats))} (a weight copied each time)"
                prod = "none" if not prods else f"{len(prods)}, {gb(sum(b for _, b in prods))}"
                what = "step" if not case.k else "round"
                print(f"  {case.label}: compiled for {target} in {secs:.1f} s; {launches.describe(kernels)} a {what}"
                      f"; Pallas kernels: {', '.join(f'{k} x{n}' for k, n in sorted(pallas.items())) or 'none'}; "
                      f"temp {temp / 1e9:.3f} GB; concatenations of 4 MB or more in the loop: {cat}; products of "
                      f"1 MB or more written out: {prod}", flush=True)
                print(f"    CUDA graphs: {graphs.describe(where, what)}", flush=True)
                if a.loop_graph and case in graphs.loop_cases(cases):
                    print(f"    CUDA graphs with --loop-graph: "
                          f"{graphs.describe(graphs.compile_dumped(lowered, graphs.LOOP_GRAPH)[1], what)}", flush=True)
                if not case.k:
                    n = kernels.total()
                    print(f"    launch budget: {launch_budget_us(step_bytes, bw, n):.2f} us per kernel beyond the "
                          f"bytes' time for a plain step at {100 * TARGET_SHARE:.0f}% of the peak ({n} kernels, "
                          f"{n / cfg.num_layers:.1f} per layer)", flush=True)
                    if a.list_kernels:
                        for i, row in enumerate(launches.kernel_list(hlo)):
                            print(f"      {i + 1:5d} {row}", flush=True)
            except Exception as e:  # noqa: BLE001 - one part that fails must not hide the others
                failures += 1
                print(f"  {name} {case.label}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    return failures
