"""CUDA graphs in a compiled decode program: what XLA put in its command buffers, read from the thunk sequence it
dumps (`compile_dumped`), and the compiler options that put the whole decode loop in one graph (LOOP_GRAPH).

By default (jax 0.10.2, a CUDA 12.3+ driver) XLA records the body of the decode loop as one CUDA graph: every
kernel of a step or round, the Pallas kernels and gemms included, goes in one launch (a loop inside the body that
XLA cannot record runs on the host between graphs: speculative.DRAFT_UNROLLED removed the only one). The loop
itself stays on the host: each step the condition kernel runs, its predicate is copied back and the host waits
for it before it launches the next step's graph, a round trip a step. WHILE in the command buffer types
(LOOP_GRAPH) records the loop as a CUDA conditional node, so the whole loop is one graph: no host round trip
until the last step. Which is faster is for a GPU to say (cli.py --loop-graph times both in one run); what each
compiles to is read here."""

import contextlib
import glob
import os
import re
import shutil
import tempfile

# XLA's default command buffer types in jax 0.10.2, and WHILE; a graph of any size (the loop alone is one command)
LOOP_GRAPH = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,"
                                               "CONDITIONAL,WHILE",
              "xla_gpu_graph_min_graph_size": 1}

# The run's XLA kernel cache (xla_gpu_kernel_cache_file), beside its compilation cache: a Triton kernel that one
# program's compile took through ptxas is read back by every later program holding the same kernel (deviceless, a
# 4-layer 35B-A3B int4 step compiled in 18 s, then 0.4 s). A run's first program pays every kernel it holds. Set by
# kernel_cache(); XLA's CPU compiler reads no GPU option.
KERNEL_CACHE = None


@contextlib.contextmanager
def kernel_cache(folder):
    """Within it, compiler_options() names a kernel cache file in `folder` (None: no kernel cache)."""
    global KERNEL_CACHE
    before, KERNEL_CACHE = KERNEL_CACHE, (os.path.join(folder, "xla_gpu_kernels") if folder else None)
    try:
        yield KERNEL_CACHE
    finally:
        KERNEL_CACHE = before


def compiler_options(extra=None):
    """XLA compiler options for a compile of this run: `extra` (LOOP_GRAPH, a dump folder) and the kernel cache;
    None when there are none. A second process reading the persistent cache must pass the same (the options are
    part of the cache key): the cached start's child runs within kernel_cache() of the same folder."""
    out = dict(extra or {})
    if KERNEL_CACHE:
        out["xla_gpu_kernel_cache_file"] = KERNEL_CACHE
    return out or None


def loop_cases(cases) -> list:
    """The cases --loop-graph compiles (and on a GPU times) again: the plain step and the first native round."""
    return [c for c in cases if not c.k][:1] + [c for c in cases if c.k and c.window is None][:1]


_THUNK = re.compile(r"^( *)\d+: (k\w+)")
_STRUCTURE = ("kCommandBuffer", "kWhile", "kConditional", "kSequential")


def structure(text: str) -> dict:
    """What a thunk sequence dump (`thunk_sequence*.txt`) says of its decode loop, the top-level while with the most
    thunks: loop_in_graph (the while itself inside a command buffer), graphs (command buffers inside the loop),
    in_graphs / outside (the loop's thunks inside a command buffer, and not), host_loops (whiles inside the loop
    that run on the host). Nesting is read from the indentation. {} if the sequence holds no loop."""
    loops, stack = [], []  # stack: (indent, kind, index into loops or None) of the open ancestors
    for line in text.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue  # "condition:", "body:" labels
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        at = next((j for j, (_, _, i) in enumerate(stack) if i is not None), None)  # the loop above, if any
        in_graph = any(k == "kCommandBuffer" for _, k, _ in stack)
        if kind == "kWhile" and at is None:
            loops.append({"loop_in_graph": in_graph, "graphs": 0, "in_graphs": 0, "outside": 0, "host_loops": 0})
            stack.append((indent, kind, len(loops) - 1))
            continue
        if at is not None:
            got, below = loops[stack[at][2]], [k for _, k, _ in stack[at + 1:]]
            if kind == "kCommandBuffer" and "kCommandBuffer" not in below:
                got["graphs"] += 1
            elif kind == "kWhile" and not in_graph:
                got["host_loops"] += 1
            elif kind not in _STRUCTURE:
                got["in_graphs" if in_graph else "outside"] += 1
        stack.append((indent, kind, None))
    return max(loops, key=lambda d: d["in_graphs"] + d["outside"], default={})


def describe(s: dict, what: str = "step") -> str:
    """One line for structure(): where the decode loop's thunks run (`what`: an iteration, a step or a round)."""
    if not s:
        return "no loop in the program"
    nested = f"; {s['host_loops']} inner loop(s) on the host" if s["host_loops"] else ""
    if s["loop_in_graph"]:
        return (f"the whole loop one CUDA graph (a conditional node), {s['in_graphs']} thunks: no host round "
                f"trip{nested}")
    total = s["in_graphs"] + s["outside"]
    return (f"the loop on the host (its predicate read back each {what}), {s['in_graphs']} of its {total} thunks in "
            f"{s['graphs']} graph{'s' if s['graphs'] != 1 else ''} a {what}{nested}")


def compile_dumped(lowered, options=None):
    """(lowered compiled with `options` (compiler options: LOOP_GRAPH or None), structure() of its thunk sequence
    after XLA's thunk passes). The dump goes to a temporary folder, removed after."""
    folder = tempfile.mkdtemp(prefix="gpu_scale_thunks_")
    try:
        compiled = lowered.compile(compiler_options=compiler_options({**(options or {}), "xla_dump_to": folder}))
        after = glob.glob(os.path.join(folder, "*thunk_sequence_after_thunk_passes.txt"))
        found = after or glob.glob(os.path.join(folder, "*thunk_sequence.txt"))  # no pass changed anything
        if not found:
            raise RuntimeError(f"XLA wrote no thunk sequence to {folder} (a program compiled for a GPU writes one)")
        with open(found[0]) as f:
            return compiled, structure(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
