"""The command line: the flags, the plan of each model (cases in priority order, each at every context), the
--budget (a part not expected to end within its model's share of the time left is skipped and named), and the
closing summary. `main` returns the exit code: 1 when a part failed (raised), else 0."""

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax

from . import graphs, launch_probe, launches, report
from .models import (
    RUNS,
    build_model,
    config,
    draft_vocab_model,
    free_bytes,
    need_bytes,
    peak_bandwidth,
    random_like,
)
from .programs import (
    Case,
    compile_case,
    head_cache_shapes,
    lower_case,
    time_case,
)
from .reads import weight_parts

GPU = {"contexts": "4096,131072,1048576", "window": 4032, "sinks": 64, "draft_vocab": 32768, "steps": 32, "rounds": 16}
SHORT = {"contexts": "64,256,1024", "window": 32, "sinks": 4, "draft_vocab": 128, "steps": 4, "rounds": 3}
RESERVE_CACHED = {True: 10.0, False: 60.0}  # seconds kept for the cached start (short, GPU)
HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv):
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_scale",
                                 description=sys.modules[__package__].__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    ap.add_argument("--short", action="store_true", help="tiny configs (CI, CPU): the same parts, in seconds")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma separated, of {list(RUNS)}")
    ap.add_argument("--k", default="1,2,3,4", help="drafts per round to measure (k = 3 first)")
    ap.add_argument("--contexts", default=None, help="cached positions, comma separated (default: "
                    f"{GPU['contexts']}; --short {SHORT['contexts']})")
    ap.add_argument("--draft-vocab", type=int, default=None, help="ids of the draft vocabulary rounds (default "
                    f"{GPU['draft_vocab']}; --short {SHORT['draft_vocab']}); 0: no draft-vocabulary rounds")
    ap.add_argument("--memory", type=float, default=None, help="bytes the device may use (default: its free memory)")
    ap.add_argument("--compile-cache", default=None, help="jax's persistent compile cache folder, kept (default: a new "
                    "empty one, so the first compile is a real one, removed at the end)")
    ap.add_argument("--no-cached-start", action="store_true", help="skip the second process")
    ap.add_argument("--compile-for", choices=("H100", "H200"), default=None,
                    help="compile every program for this GPU on this machine (no GPU needed: XLA's GPU compiler "
                    "run deviceless, pip install -e '.[gpu-compile]') and print the kernels a step launches; "
                    "nothing runs (compile_only.py)")
    ap.add_argument("--list-kernels", action="store_true",
                    help="with --compile-for: after each plain step's line, every kernel of one step in order "
                    "(opcode, a fusion's root op, result type, a Pallas kernel's name): where a step's launches go")
    ap.add_argument("--loop-graph", action="store_true",
                    help="the plain step and the first native round again with the whole decode loop one CUDA graph "
                    "(graphs.py LOOP_GRAPH: XLA's default puts a step's kernels in one graph, the loop on the host): "
                    "each timed both ways, the ratio printed; with --compile-for, what each compiles to")
    ap.add_argument("--cached-child", default=None, help=argparse.SUPPRESS)  # JSON: what the second process lowers
    a = ap.parse_args(argv)
    if a.draft_vocab is not None and a.draft_vocab < 0:
        ap.error(f"--draft-vocab: expected ids >= 0, found {a.draft_vocab}")
    if a.list_kernels and not a.compile_for:
        ap.error("--list-kernels: lists a compiled program's kernels; needs --compile-for H100 or H200")
    if a.budget <= 0:
        ap.error(f"--budget: expected seconds > 0, found {a.budget:g}")
    bad = [r for r in a.runs.split(",") if r not in RUNS]
    if bad:
        ap.error(f"--runs: expected names of {list(RUNS)}, found {bad}")
    try:
        a.ks = sorted({int(k) for k in a.k.split(",")}, key=lambda k: (k != 3, k))
        a.ctxs = sorted({int(c) for c in (a.contexts or (SHORT if a.short else GPU)["contexts"]).split(",")})
        assert all(1 <= k <= 16 for k in a.ks) and all(c >= 1 for c in a.ctxs)
    except (ValueError, AssertionError):
        ap.error(f"--k / --contexts: expected positive integers separated by commas, found {a.k!r} / {a.contexts!r}")
    return a


def cases(ks, p):
    """Priority order: plain, then k = 3 (native, windowed, each with the draft vocabulary), then the other k.
    main runs plain, k = 3 native and windowed on every run first, then the rest."""
    out = [Case()]
    for k in ks:
        out += [Case(k), Case(k, p["window"], p["sinks"])]
        if p["draft_vocab"]:
            out += [Case(k, draft_vocab=p["draft_vocab"]), Case(k, p["window"], p["sinks"], p["draft_vocab"])]
    return out


class Budget:
    def __init__(self, seconds, reserve):
        self.end = time.perf_counter() + seconds - reserve
        self.skipped = []
        self.no_room = set()  # runs with no context that fits in memory

    def left(self):
        return self.end - time.perf_counter()

    def fits(self, what, share_end, estimate):
        if time.perf_counter() + estimate <= share_end:
            return True
        self.skipped.append(what)
        print(f"  {what}: skipped for the --budget (about {estimate:.0f} s expected, "
              f"{max(0.0, share_end - time.perf_counter()):.0f} s left in this model's share)", flush=True)
        return False


def run_model(name, plan, a, p, budget, share_end, results):
    """The cases of `plan` on run `name` at every context that fits in memory: the model made (again in a later
    pass: a few seconds, its programs cached), its caches filled, each case compiled and timed. Returns the
    number of failed parts."""
    real, quant = RUNS[name]
    short, B, dtype = a.short, 1, "bfloat16"
    ks = max(a.ks)
    margin = (p["steps"] + 2) + (p["rounds"] + 2) * (ks + 1) + 8
    ctxs = list(a.ctxs)
    free = free_bytes(a.memory)
    again = name in results
    while ctxs:  # memory first: drop the largest contexts that do not fit
        slots = ctxs[-1] + margin
        cfg = config(real, short, slots)
        need, parts = need_bytes(cfg, dtype, quant, B, slots, p["draft_vocab"])
        if need <= free:
            break
        if not again:
            print(f"  {name} at {ctxs[-1]} positions: skipped, needs {need / 1e9:.1f} GB ("
                  + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items()) + f") of {free / 1e9:.1f} GB free",
                  flush=True)
            budget.skipped.append(f"{name} at {ctxs[-1]} positions (memory)")
        ctxs.pop()
    if not ctxs:
        budget.no_room.add(name)
        return 0
    t = time.perf_counter()
    model = build_model(cfg, dtype, quant, name)
    jax.block_until_ready(model.weights)
    build_s = time.perf_counter() - t
    wparts = weight_parts(model.weights, cfg)
    state0, head0 = (random_like(s, i) for i, s in enumerate(
        jax.eval_shape(lambda: _states(cfg, B, slots, dtype)), start=1))
    print(f"== {name}{' (again, for the next cases)' if again else ''}: {cfg.num_layers} layers + MTP head, "
          f"{report.weights_line(model, wparts)}, made on the device in {build_s:.1f} s; caches of {slots} "
          "positions filled with random values", flush=True)
    res = results.setdefault(name, {"cfg": cfg, "slots": slots, "plain": {}, "rounds": {}, "compile": {},
                                    "kernels": {}, "parts": wparts})
    failures, compile_est, state, native_head = 0, max(res["compile"].values(), default=0.0), state0, head0
    dv_model = None
    cap_plain, cap_spec = p["steps"] + 4, (p["rounds"] + 2) * (ks + 1) + 8
    for case in plan:
        est = compile_est + len(ctxs) * 2.0 * (0.2 if short else 1.0)
        if not budget.fits(f"{name} {case.label}", share_end, est):
            continue
        try:
            cap = cap_plain if not case.k else cap_spec
            compiled, secs = compile_case(cfg, dtype, quant, case, B, slots, cap)
            compile_est = max(compile_est, secs)
            res["compile"][case.label] = secs
            kernels = launches.per_iteration(compiled.as_text())
            res["kernels"][case.label] = kernels.total()
            weights = model.weights
            if case.draft_vocab:
                dv_model = dv_model or draft_vocab_model(model, case.draft_vocab)
                weights = dv_model.weights
            head = native_head if case.window is None else random_like(
                head_cache_shapes(cfg, case, B, slots, dtype), 3)
            line = []
            for ctx in ctxs:
                sec, state, head = time_case(compiled, cfg, case, B, ctx, cap, dtype, weights, state, head, p)
                if not case.k:
                    res["plain"][ctx] = sec
                else:
                    res["rounds"][(case, ctx)] = sec
                line.append(f"{ctx}: {1e3 * sec:.3f} ms")
            if case.window is None:
                native_head = head
            print(f"  {case.label}: compiled in {secs:.1f} s, {launches.describe(kernels)} a "
                  f"{'step' if not case.k else 'round'} (launches.py); per {'step' if not case.k else 'round'} "
                  + ", ".join(line), flush=True)
            if a.loop_graph and case in graphs.loop_cases(plan):
                state, native_head = loop_graph(cfg, dtype, quant, case, B, slots, cap, ctxs, p, res, weights, state,
                                                native_head)
        except Exception as e:  # noqa: BLE001 - one part that fails must not hide the others
            failures += 1
            print(f"  {name} {case.label}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            state, native_head = (random_like(s, i) for i, s in enumerate(  # a failed call may have consumed them
                jax.eval_shape(lambda: _states(cfg, B, slots, dtype)), start=1))
    res["ctxs"] = ctxs
    return failures


def loop_graph(cfg, dtype, quant, case, B, slots, cap, ctxs, p, res, weights, state, head):
    """--loop-graph: `case` compiled with the whole loop one CUDA graph (graphs.LOOP_GRAPH), what XLA made of it,
    and its time at each context beside the default program's. Returns the state and head it leaves."""
    lowered, secs = lower_case(cfg, dtype, quant, case, B, slots, cap)
    t = time.perf_counter()
    if jax.default_backend() == "gpu":
        compiled, where = graphs.compile_dumped(lowered, graphs.LOOP_GRAPH)
        where = graphs.describe(where, "step" if not case.k else "round")
    else:  # XLA's CPU compiler reads no GPU option: the same program (the short form's check of this path)
        compiled = lowered.compile(compiler_options=graphs.compiler_options(graphs.LOOP_GRAPH))
        where = f"no CUDA graphs on {jax.default_backend()}"
    secs += time.perf_counter() - t
    line = []
    for ctx in ctxs:
        sec, state, head = time_case(compiled, cfg, case, B, ctx, cap, dtype, weights, state, head, p)
        base = res["plain"][ctx] if not case.k else res["rounds"][(case, ctx)]
        line.append(f"{ctx}: {1e3 * sec:.3f} ms ({sec / base:.3f} of the default's)")
    print(f"  {case.label}, --loop-graph: compiled in {secs:.1f} s, {where}; per "
          f"{'step' if not case.k else 'round'} " + ", ".join(line), flush=True)
    return state, head


def _states(cfg, B, slots, dtype):
    from qwen_mtp.head.mtp import init_mtp_cache
    from qwen_mtp.trunk.state import init_state

    return init_state(cfg, B, slots, dtype), init_mtp_cache(cfg, B, slots, dtype)


def cached_start(a, p, results, cache_dir, timeout):
    """A second process lowering the first model's compiled programs with the persistent cache warm."""
    name = next((n for n, r in results.items() if r["compile"]), None)
    if name is None:
        return None
    res = results[name]
    labels = list(res["compile"])[:3]
    ks = max(a.ks)
    slots = res["slots"]
    child = {"run": name, "labels": labels, "short": a.short, "slots": slots, "ks": a.ks, "steps": p["steps"],
                 "rounds": p["rounds"], "kmax": ks}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, HERE, "--cached-child", json.dumps(child), "--compile-cache", cache_dir]
                         + (["--short"] if a.short else []), check=False, capture_output=True, text=True,
                         timeout=timeout)
    wall = time.perf_counter() - t
    got = [json.loads(x[len("CACHED "):]) for x in out.stdout.splitlines() if x.startswith("CACHED ")]
    if out.returncode or not got:
        raise RuntimeError(f"the second process failed (rc {out.returncode}): {out.stderr.strip()[-300:]}")
    return name, got[0], wall, {lab: res["compile"][lab] for lab in labels}


def child_main(a, p):
    """The second process: lower and compile the named programs (reading the persistent cache)."""
    spec = json.loads(a.cached_child)
    real, quant = RUNS[spec["run"]]
    cfg = config(real, spec["short"], spec["slots"])
    by_label = {c.label: c for c in cases(spec["ks"], p)}
    times = {}
    for label in spec["labels"]:
        case = by_label[label]
        cap = spec["steps"] + 4 if not case.k else (spec["rounds"] + 2) * (spec["kmax"] + 1) + 8
        times[label] = compile_case(cfg, "bfloat16", quant, case, 1, spec["slots"], cap)[1]
    print("CACHED " + json.dumps({"times": times, "process_s": time.perf_counter() - T0}), flush=True)
    return 0


T0 = time.perf_counter()


def main(argv=None):
    t0 = time.perf_counter()
    a = parse(argv)
    p = dict(SHORT if a.short else GPU)
    if a.draft_vocab is not None:
        p["draft_vocab"] = a.draft_vocab
    if a.compile_for:
        from qwen_mtp.tools import gpu_compile

        from . import compile_only

        gpu_compile.prepare()
        budget = Budget(a.budget, 0.0)
        with tempfile.TemporaryDirectory(prefix="gpu_scale_kernels_") as folder, graphs.kernel_cache(folder):
            failures = compile_only.run(a, p, budget, cases(a.ks, p))
        tail = f"; {len(budget.skipped)} parts skipped for the --budget" if budget.skipped else ""
        print(f"{'FAIL' if failures else 'OK'}: {failures} failures in {time.perf_counter() - t0:.0f} s{tail}",
              flush=True)
        return 1 if failures else 0
    if a.cached_child:
        import qwen_mtp

        with graphs.kernel_cache(qwen_mtp.enable_compile_cache(a.compile_cache)):
            return child_main(a, p)
    with compile_cache(a.compile_cache) as cache_dir, graphs.kernel_cache(cache_dir):
        return measure(a, p, cache_dir, t0)


@contextlib.contextmanager
def compile_cache(path):
    """jax's persistent cache in `path`, or in a fresh folder (cold compiles: the times printed are compiles, not
    reads) that is removed at the end, with what was written there. The process's own cache setting (a caller's
    folder, or none) is put back after: run in-process (tests/test_gpu_scale.py), gpu_scale must not leave the
    caller compiling into its folder, nor folders behind in the temporary directory."""
    import qwen_mtp

    before = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    made = None if path else tempfile.mkdtemp(prefix="gpu_scale_jax_cache_")
    try:
        yield qwen_mtp.enable_compile_cache(path or made)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
        if before:
            qwen_mtp.enable_compile_cache(before)
        else:
            qwen_mtp.disable_compile_cache()


def measure(a, p, cache_dir, t0):
    """The device run: the launch probe, every run's cases within the budget, the tables, the cached start."""
    kind, bw = peak_bandwidth()
    print(f"gpu_scale: {jax.default_backend()} {kind} (peak {report.tb(bw)}), jax {jax.__version__}, platform "
          f"{jax.devices()[0].client.platform_version!r}, budget "
          f"{a.budget:.0f} s, batch 1, bf16 activations; compile cache {cache_dir}", flush=True)
    reserve = 0.0 if a.no_cached_start else RESERVE_CACHED[a.short]
    budget = Budget(a.budget, reserve)
    per_kernel, n, secs = launch_probe.measure()
    print(f"launch probe: a chain of {n} tiny dependent kernels a loop iteration (launch_probe.py; its compile "
          f"{secs:.1f} s): {1e6 * per_kernel:.2f} us a kernel", flush=True)
    runs = a.runs.split(",")
    results, failures = {}, 0
    every = cases(a.ks, p)
    first = every[:1] + [c for c in every if c.k == a.ks[0] and not c.draft_vocab]  # plain, native, windowed
    for plan in (first, [c for c in every if c not in first]):  # every run's first cases, then the rest
        if not plan:
            continue
        for i, name in enumerate(runs):
            if name in budget.no_room:
                continue
            share_end = time.perf_counter() + max(0.0, budget.left()) / (len(runs) - i)
            if budget.left() <= 0:
                budget.skipped.append(f"{name}: {', '.join(c.label for c in plan)}")
                print(f"== {name}: {', '.join(c.label for c in plan)} skipped for the --budget", flush=True)
                continue
            try:
                failures += run_model(name, plan, a, p, budget, share_end, results)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"== {name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            gc.collect()  # the model and its caches are gone before the next one is made
    for name, res in results.items():
        report.model_table(name, res, res.get("ctxs", []), a.ks, p, 1, bw, "bfloat16", per_kernel=per_kernel)
    report.paper_table(results, a.ctxs, a.ks, p, bw)
    if a.no_cached_start:
        print("cached start: not run (--no-cached-start)", flush=True)
    else:
        try:
            got = cached_start(a, p, results, cache_dir, max(30.0, budget.left() + reserve))
            report.cached_line(got)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"cached start: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    took = time.perf_counter() - t0
    tail = f"; {len(budget.skipped)} parts skipped for the --budget or memory" if budget.skipped else ""
    print(f"{'FAIL' if failures else 'OK'}: {failures} failures in {took:.0f} s{tail}", flush=True)
    return 1 if failures else 0
