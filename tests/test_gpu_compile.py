"""qwen_mtp.tools.gpu_compile: programs compiled for an H200 by XLA's own GPU compiler on this CPU, deviceless.

Beyond tests/test_export_cuda.py (jax.export: the lowering, up to where XLA takes over) and the `triton`
package's sm_90 compile of the kernels' IR (a close proxy): here XLA itself compiles the programs for sm_90,
fusion and scheduling included, each Pallas kernel through XLA's Triton and ptxas to machine code. It needs jax's
CUDA plugin, which lives in an environment of its own (.ci/run makes .venv-gpu-compile; beside a CPU jax the
plugin would look for the missing GPU in every process): the compiles run there, in subprocesses."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xla_flags

REPO = Path(__file__).resolve().parents[1]
MAKE = ("python3 -m venv --system-site-packages .venv-gpu-compile && .venv-gpu-compile/bin/python -m pip install "
        "-e '.[gpu-compile]'")


def gpu_compile_python():
    """The python that has jax's CUDA plugin: QWEN_MTP_GPU_COMPILE_PYTHON, else the repository's
    .venv-gpu-compile, else this one if it has the plugin; None when there is none."""
    if os.environ.get("QWEN_MTP_GPU_COMPILE_PYTHON"):
        return os.environ["QWEN_MTP_GPU_COMPILE_PYTHON"]
    venv = REPO / ".venv-gpu-compile" / "bin" / "python"
    if venv.exists():
        return str(venv)
    return sys.executable if importlib.util.find_spec("jax_plugins.xla_cuda12") else None


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """(the python with the plugin, the environment its compiles run in). The module's compiles share one XLA
    kernel cache (xla_gpu_kernel_cache_file): a Triton kernel compiled to machine code once (ptxas included) is
    read back by every later program that holds the same kernel, in this file's subprocesses one after another
    (a 35B-A3B int4 step of 4 layers: 20 s to compile, 0.5 s the second time). Each kernel is still compiled
    once here; what the tests read (the optimised HLO, its kernels, errors) does not depend on the cache."""
    py = gpu_compile_python()
    if py is None:
        why = f"compiling for a GPU on this CPU needs jax's CUDA plugin: {MAKE}"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":  # CI makes the environment and requires these tests
            pytest.fail(why)
        pytest.skip(why)
    cache = tmp_path_factory.mktemp("xla_kernel_cache") / "kernels"
    env = xla_flags.defaults_env()  # XLA's own flags, as on the GPU (the session's CPU flags gain nothing here)
    return py, {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_gpu_kernel_cache_file={cache}".strip()}


def _run(python, *args, timeout=900):
    python, env = python
    out = subprocess.run([python, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                         env=env)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    return out.stdout


def test_decode_programs_compile_for_h200(python):
    """gpu_scale --compile-for H200, short form: the plain step and the k = 3 rounds (native, Wind-MTP) of an int4
    MoE compile for the GPU; each line counts the kernels the program launches and names its Pallas kernels (the
    quantized matmuls, the routed experts, both attentions, the GDN step or verify: chosen for cuda). The dense
    bf16 trunk's round compiles in test_no_weight_is_copied_in_a_decode_loop (27B, real width)."""
    out = _run(python, "benchmarks/gpu_scale", "--compile-for", "H200", "--short", "--runs", "35B-A3B-int4",
               "--k", "3", "--draft-vocab", "0", "--budget", "600", "--list-kernels", "--loop-graph")
    assert out.rstrip().splitlines()[-1].startswith("OK: 0 failures"), out
    assert "XLA's GPU compiler on this host, deviceless" in out
    probe = re.search(r"launch probe \(launch_probe.py\) compiled for H200: (\d+) kernels \(fusion", out)
    assert probe and 256 <= int(probe.group(1)) <= 260, out  # the chain stays unfused for the GPU: one per link
    got = {}
    for block in out.split("== ")[1:]:
        name = block.split(":")[0]
        for m in re.finditer(r"^  (.+?): compiled for H200 in [\d.]+ s; (\d+) kernels \((?:fusion|custom-call) "
                             r"\d+[^)]*\) a (step|round); Pallas kernels: (.+); temp", block, re.M):
            got[(name, m.group(1))] = (int(m.group(2)), m.group(4))
    assert set(got) == {("35B-A3B-int4", c) for c in ("plain", "k3 native", "k3 windowed W32 S4")}, (got, out)
    for (name, case), (kernels, pallas) in got.items():
        assert kernels > 20, (name, case, kernels)  # a 4-layer step launches dozens
        assert ("windowed_draft_attention" in pallas) == ("windowed" in case), (name, case, pallas)
        assert "causal_attention" in pallas, (name, case, pallas)
        assert ("gdn_decode_step" if case == "plain" else "gdn_verify") in pallas, (name, case, pallas)
        assert "moe_gemv_int4" in pallas and "quant_matmul_int4" in pallas, (name, case, pallas)
    assert got[("35B-A3B-int4", "k3 native")][0] > got[("35B-A3B-int4", "plain")][0]
    # --list-kernels: the plain step's kernels one a line, in order, as many as its count (no nested loop there)
    listed = re.findall(r"^ {6} *\d+ (\S+) .*$", out, re.M)
    assert len(listed) == got[("35B-A3B-int4", "plain")][0], listed
    names = re.findall(r"^ {6} *\d+ custom-call .* (\w+)$", out, re.M)
    assert names.count("gdn_decode_step") == 3 and "moe_gemv_int4" in names, names
    # the GDN conv is one kernel a layer, its state written in place: no copy of a conv state [1, 3, C] is left
    assert names.count("gdn_conv_step") == 3, names
    assert not re.findall(r"^ {6} *\d+ copy +\S*\[1,3,\d+\]", out, re.M), out
    # the router's top-k is one kernel a MoE layer (moe_router.py), where XLA sorted the experts and sliced the ids
    assert names.count("moe_router_topk") == 4, names
    assert not re.findall(r"^ {6} *\d+ fusion +sort ", out, re.M), out
    assert out.count("concatenations of 4 MB or more in the loop: none") == 3, out
    assert out.count("products of 1 MB or more written out: none") == 3, out
    assert out.count("launch budget: ") == 1  # from the plain step
    # CUDA graphs (gpu_compile's CUDA 12.4 driver): by default each program's loop body is one graph, every kernel
    # in it, Pallas kernels included (all but the loop condition's), a round's draft steps too (unrolled for cuda:
    # speculative.DRAFT_UNROLLED; as a loop they ran on the host); --loop-graph puts the loop itself in it
    assert "inner loop" not in out, out
    body = re.findall(r"^    CUDA graphs: the loop on the host \(its predicate read back each (?:step|round)\), "
                      r"(\d+) of its (\d+) thunks in 1 graph a (?:step|round)$", out, re.M)
    assert len(body) == 3 and all(int(n) == int(total) - 1 for n, total in body), out
    assert int(body[0][1]) >= got[("35B-A3B-int4", "plain")][0], (body, got)
    whole = re.findall(r"^    CUDA graphs with --loop-graph: the whole loop one CUDA graph \(a conditional node\), "
                       r"(\d+) thunks: no host round trip$", out, re.M)
    assert [int(n) for n in whole] == [int(t) for _, t in body[:2]], (whole, body)  # plain, k3 native


def test_tree_rounds_are_one_cuda_graph(python, report):
    """tests/gpu_compile_kernels.py --trees: a sampled static tree's round and a greedy dynamic tree's, compiled for
    an H200, each one CUDA graph but for the loop's condition (XLA's command buffers, read from its thunk dump).
    Fails at the commit before tree_draft joined its levels: the sampled tree was 3 graphs, split by two copies."""
    rows = [json.loads(x) for x in _run(python, "tests/gpu_compile_kernels.py", "H200", "--trees").splitlines()
            if x.startswith("{")]
    assert [r["label"] for r in rows] == ["sampled static tree (2, 2, 1)", "greedy dynamic tree"], rows
    for r in rows:
        g = r["graphs"]
        assert g["graphs"] == 1 and g["outside"] == 1 and not g["host_loops"] and g["in_graphs"] > 100, r
        report(f"XLA compile for an H200 (deviceless), {r['label']}: {g['in_graphs']} thunks in one CUDA graph a "
               f"round, {r['seconds']:.1f} s")


def test_no_weight_is_copied_in_a_decode_loop(python, report):
    """A speculative round of 4 real-width layers of 27B and of 35B-A3B (bf16) compiled for an H200 holds no
    concatenation of 512 KB or more in its loop (b and a's weights were one), nor does 35B-A3B's plain step write
    out a weight-sized product, and a round launches fewer kernels with the GDN verify kernel than with its XLA
    reference, and a MoE plain step fewer with the router's top-k kernel, with gate / up reading the token's row,
    with the experts' SwiGLU in two kernels, with the GDN step kernel writing out_proj's two rows, with the input
    norm's kernel writing its row's two rows and with the shared expert in the routed experts' launches than
    without, and a 27B plain step fewer with the RMSNorm kernel and with its KV rows written by their
    dynamic-update-slice, and a 27B int4 plain step fewer with its MLPs' gate and up in one launch, with K's
    partials summed in chunks XLA fuses, with its GDN qkv / z partials summed by the conv and step kernels and
    with its attention queries by their kernel, and at a batch of 4 with the tensor-core kernel's partials summed
    by the kernels that read them, and a 27B int4 round fewer with the verify's z, b and a partials summed by its
    kernel and with its MLPs' gate and up in one tensor-core launch, and a 27B round (int4 and bf16) fewer with
    the GDN rollback's kernel.
    Before gdn.in_projections, XLA's dot merger joined the four GDN in-projections over their weights
    concatenated in the loop: a copy of 169 MB (27B) per GDN layer at every round, 16 GB a round at full depth.
    The same program with the four dots on one x shows the probe finds it."""
    rows = {r["label"]: r for r in (json.loads(x) for x in _run(python, "tests/gpu_compile_kernels.py", "H200",
                                                                   "--loops").splitlines() if x.startswith("{"))}
    assert rows["27B k1 native"]["concatenations"] == [], rows
    assert rows["35B-A3B k1 native"]["concatenations"] == [], rows
    before = rows["27B k1 native, the in-projections on one x (before the fix)"]["concatenations"]
    assert [b for _, b in before] == [5120 * 16480 * 2] * 3, before  # one per GDN layer: qkv | z | b | a
    # ... nor of 512 KB or more: b and a over the round's rows each from a copy of x of its own (gdn.in_projections);
    # on one x, XLA merged them over their weights concatenated in the loop (27B: 2 x 5120 x 48 bf16 a GDN layer)
    # and ran the product, then two slices of it: a kernel a GDN layer more
    for label in ("27B k1 native", "35B-A3B k1 native"):
        assert rows[label]["small_concatenations"] == [], (label, rows[label]["small_concatenations"])
    merged = rows["27B k1 native, b and a on one x"]
    assert [b for _, b in merged["small_concatenations"]] == [5120 * 96 * 2] * 3, merged
    assert rows["27B k1 native"]["kernels"] + 3 <= merged["kernels"], (rows["27B k1 native"], merged)
    # no weight-sized product written out (a strength-reduced dot, ops.VECTOR_DOT_MAX); without the two rows,
    # 35B-A3B's plain step writes out its GDN out_proj's (f32 4096 x 2048, 32 MB) among others
    for label in ("27B k1 native", "35B-A3B k1 native", "35B-A3B plain"):
        assert rows[label]["products"] == [], (label, rows[label]["products"])
    one_row = rows["35B-A3B plain, one row through every weight (VECTOR_DOT_MAX 0)"]["products"]
    assert ["f32[4096,2048]{1,0}", 4096 * 2048 * 4] in one_row and sum(b for _, b in one_row) > 100e6, one_row
    # the GDN verify as one kernel (kernels_pallas/gdn_verify.py): at least 8 kernels fewer a GDN layer than its
    # XLA reference (the 3 GDN layers: 136 against 167 when written)
    xla_ops = rows["27B k1 native, the GDN verify in XLA ops (its reference)"]["kernels"]
    assert rows["27B k1 native"]["kernels"] + 3 * 8 <= xla_ops, rows
    # the MoE block: the router's top-k as one kernel (moe_router.py; XLA's lax.top_k is a sort and a slice) and
    # the routed gate / up reading each token's row where the router's product reads it (moe_gemv's rows_per_x;
    # k copies of it were a fusion of their own): a kernel a MoE layer fewer each (4 layers: 126 -> 122 -> 118)
    plain = rows["35B-A3B plain"]["kernels"]
    assert plain + 4 <= rows["35B-A3B plain, the router's top-k by lax.top_k"]["kernels"], rows
    apart = rows["35B-A3B plain, the shared expert apart"]["kernels"]  # (the routed experts' launches alone)
    assert apart + 4 <= rows["35B-A3B plain, gate / up on copies of the row"]["kernels"], rows
    # the routed experts' SwiGLU in two kernels (moe_expert_mlp.py) where gate, up and down were three and XLA's
    # activation between them a fourth: two kernels a MoE layer fewer (4 layers: 110 -> 102)
    assert plain + 8 <= rows["35B-A3B plain, the experts' SwiGLU in three calls"]["kernels"], rows
    # the GDN step kernel writes out_proj's input as the two rows its product takes (gdn_step's pad_row): a pad
    # kernel a GDN layer fewer (3 of the 4 layers; at 27B XLA runs the one-row out_proj unpadded, 31M > VECTOR_DOT_MAX)
    assert plain + 3 <= rows["35B-A3B plain, out_proj's input padded after the GDN step kernel"]["kernels"], rows
    # a layer's input norm writes the row's two rows (rmsnorm's pad_row): XLA's pad after the kernel, a kernel a
    # layer fewer (4 layers: every 35B-A3B mixer has an in-projection ops.linear pads)
    assert plain + 4 <= rows["35B-A3B plain, the input norm's two rows made by XLA"]["kernels"], rows
    # ... and with int4 experts, the post norm's kernel writing the router's two rows (the input norms pad nothing
    # there: the in-projections are quantized): a kernel a MoE layer fewer
    int4 = rows["35B-A3B int4 plain"]["kernels"]
    assert int4 + 4 <= rows["35B-A3B int4 plain, the norms' two rows made by XLA"]["kernels"], rows
    # the shared expert as one more pair a token in the routed experts' two launches (mlp._routed_and_shared): its
    # gate / up and down (and int4: its activation) kernels gone, 2 a MoE layer fewer in bf16, 3 in int4
    assert plain + 8 <= rows["35B-A3B plain, the shared expert apart"]["kernels"], rows
    assert int4 + 12 <= rows["35B-A3B int4 plain, the shared expert apart"]["kernels"], rows
    # a MoE block's combine, the residual add and the next layer's input norm (after the last, the final norm) in
    # one kernel at one row (moe_add_rmsnorm.py, forward.HAND_ON): a kernel a layer fewer (4 layers: bf16 82 -> 78,
    # int4 77 -> 73)
    assert plain + 4 <= rows["35B-A3B plain, the MoE block's add apart from the next norm"]["kernels"], rows
    assert int4 + 4 <= rows["35B-A3B int4 plain, the MoE block's add apart from the next norm"]["kernels"], rows
    # a layer's input norm and the final norm at one row as one kernel (kernels_pallas/rmsnorm.py) where XLA ran a
    # reduce and the normed row: a kernel a GDN layer and one for the final norm fewer (3 GDN layers + 1)
    assert rows["27B plain"]["kernels"] + 4 <= rows["27B plain, the input and final norms in XLA ops"]["kernels"], rows
    # an attention layer's new rows by attention_rows.py's kernel: in bf16, k's norm and the two caches' updates
    # gone (XLA's split-K sums of the products stay), 3 kernels; where XLA writes the rows, a batch of one row's KV
    # cache by its dynamic-update-slice (attention.ONE_ROW_WRITE): XLA fuses the new rows' computation into the
    # update, where the scatter's select took them kernels of their own
    xla_rows = rows["27B plain, the attention's new rows in XLA ops"]["kernels"]
    assert rows["27B plain"]["kernels"] + 3 <= xla_rows, rows
    assert xla_rows + 2 <= rows["27B plain, XLA's KV rows written by a scatter"]["kernels"], rows
    # a layer's residual add after its mixer and its post norm in one kernel (add_rmsnorm.py, forward.ADD_NORM),
    # the out-projection's partials summed in it: a kernel a layer fewer (4 layers)
    assert rows["27B int4 plain"]["kernels"] + 4 <= \
        rows["27B int4 plain, the residual add and the post norm apart"]["kernels"], rows
    # a quantized MLP's gate and up in one launch (quant_gate_up.py): a kernel a layer fewer (4 layers)
    assert rows["27B int4 plain"]["kernels"] + 4 <= rows["27B int4 plain, gate and up in two launches"]["kernels"], \
        rows
    # a dense MLP's residual add and the next layer's input norm (after the last, the final norm) in one kernel,
    # down handing its partials (forward.HAND_ON): a kernel a layer fewer (4 layers: 71 -> 67)
    apart = rows["27B int4 plain, the MLP's add apart from the next norm"]["kernels"]
    assert rows["27B int4 plain"]["kernels"] + 4 <= apart, rows
    # there, K's 46 partials of down summed in chunks of at most 31 (split_k.sum_parts), each inside the residual
    # add's fusion, where one reduce of 46 rows was a kernel of its own: a kernel a layer fewer
    assert apart + 4 <= rows["27B int4 plain, the MLP's add apart, K's parts summed by one reduce"]["kernels"], rows
    # the GDN qkv and z products' K partials summed by the conv and step kernels as they load them
    # (gdn.step_projections): XLA's two sums before them gone, 2 kernels a GDN layer fewer (3 GDN layers)
    assert rows["27B int4 plain"]["kernels"] + 6 <= \
        rows["27B int4 plain, the GDN in-projections' K parts summed by XLA"]["kernels"], rows
    # an attention layer's new rows by attention_rows.py's kernel (attention.QUERY_KERNEL) from the products' K
    # partials, k's and v's from one launch (quant.pair_parts): XLA's three kernels before the attention kernel and
    # its positions' one gone, k's sum and norm and the two caches' updates, and v's launch, 7 fewer (the one
    # attention layer: 82 -> 75)
    assert rows["27B int4 plain"]["kernels"] + 7 <= \
        rows["27B int4 plain, the attention's new rows in XLA ops"]["kernels"], rows
    # at a batch of 4 the tensor-core kernel's K partials summed by the GDN conv / step kernels and the queries'
    # kernel (quant_decode.decode_parts): XLA's sums gone, 2 a GDN layer and 1 an attention layer (7); b and a then
    # on copies of x of their own (gdn.step_projections), not merged over their weights concatenated in the loop
    # a round's z K partials (the tensor-core kernel's, over the verify's rows) summed by the GDN verify kernel as it
    # loads them (gdn.gdn_layer): XLA's sum of them gone, a kernel a GDN layer (3)
    assert rows["27B int4 k1 native"]["kernels"] + 3 <= \
        rows["27B int4 k1 native, the verify's z K parts summed by XLA"]["kernels"], rows
    # b and a over the verify's rows as their K partials, one batched gemm each, summed by the verify kernel
    # (gdn.gate_products): XLA's split-K gemm and its sum were two kernels each, 2 a GDN layer fewer (6)
    assert rows["27B int4 k1 native"]["kernels"] + 6 <= rows["27B int4 k1 native, b and a as products"]["kernels"], \
        rows
    # a round's MLPs' gate and up in one tensor-core launch (quant_mma's pair form, quant_gate_up.py): a kernel a
    # layer fewer (4 layers)
    assert rows["27B int4 k1 native"]["kernels"] + 4 <= \
        rows["27B int4 k1 native, gate and up in two launches"]["kernels"], rows
    # a GDN layer's rollback as one kernel, both states in place (gdn_rollback.py), where XLA ran up to four: the
    # rebuild's weights, the state's rebuild, the window's slice and its copy into the loop-carried conv state (at
    # k = 1 XLA joins the 3 layers' weights and rebuilds in one fusion each: 118 -> 115 when written); in bf16 XLA
    # writes the rows' product out for the kernel (k = 3: 195 -> 188 when written)
    assert rows["27B int4 k1 native"]["kernels"] + 3 <= \
        rows["27B int4 k1 native, the rollback in XLA ops (its reference)"]["kernels"], rows
    assert rows["27B k3 native"]["kernels"] + 4 <= rows["27B k3 native, the rollback in XLA ops (its reference)"][
        "kernels"], rows
    batch = rows["27B int4 plain batch 4"]
    assert batch["kernels"] + 7 <= \
        rows["27B int4 plain batch 4, the tensor-core kernel's K parts summed by XLA"]["kernels"], rows
    assert batch["small_concatenations"] == [], batch
    for label, r in rows.items():
        cats = r["concatenations"]
        report(f"XLA sm_90 compile (deviceless, H200), {label}: {r['kernels']} kernels an iteration, weight "
               f"concatenations in the loop {len(cats)} ({sum(b for _, b in cats) / 1e6:.0f} MB), products "
               f"written out {len(r['products'])} ({sum(b for _, b in r['products']) / 1e6:.0f} MB)")


def test_a_tensor_parallel_round_moves_no_weight(python, report):
    """The k = 3 round of 4 real-width 27B layers over 8 compile-only H200s (model 8): XLA's partitioner writes
    its collectives, and none inside the loop moves more than 1 MB (activations: the largest is 80 KB). Before
    ops.embed_rows took the rows per shard, the draft's embedding lookup re-split the whole 1.27 GB table with an
    all-to-all at every draft step: the same program with the lookup left free shows the probe finds it."""
    rows = {r["label"]: r for r in (json.loads(x) for x in _run(python, "tests/gpu_compile_kernels.py", "H200",
                                                                   "--mesh").splitlines() if x.startswith("{"))}
    fixed = rows["27B k3 native, model 8"]["collectives"]
    free = rows["27B k3 native, model 8, the head's embedding rows left free (before the fix)"]["collectives"]
    assert fixed and max(b for _, b in fixed) <= 1 << 20, sorted(fixed, key=lambda c: -c[1])[:3]
    assert ["all-to-all", 248320 * 5120 * 2 // 8] in free, sorted(free, key=lambda c: -c[1])[:3]
    for label, r in rows.items():
        c = r["collectives"]
        report(f"XLA compile for 8 H200s (deviceless), {label}: {len(c)} collectives in the loop, "
               f"{sum(b for _, b in c) / 1e6:.1f} MB, the largest {max(b for _, b in c) / 1e6:.2f} MB")


def test_every_kernel_compiles_for_h200_at_real_shapes(python, report):
    """tests/gpu_compile_kernels.py: each Pallas kernel family at real Qwen3.5 shapes (quantized matmuls of 27B
    in every format at 1 and 5 rows, its gate and up in one launch at 1 row and at 4, its k and v in one launch, the
    routed MoE experts of 35B-A3B and 397B-A17B, windowed and causal attention, the attention's new rows (queries,
    keys and values) before the causal kernel, the residual add and RMSNorm, the GDN decode step, verify, conv step
    and rollback (the step's z, the conv's row and the rollback's rows also as K partials, quant.linear_parts), the
    MoE router's top-k, the RMSNorm row) compiles for an H200 and holds its kernel; a launch over one block's shared memory is
    refused by XLA's compile (the probe reaches the machine code). Last in the file: the kernels the programs above
    hold at these shapes are read from the module's kernel cache (89 -> 59 s on this CPU alone)."""
    rows = [json.loads(x) for x in _run(python, "tests/gpu_compile_kernels.py", "H200").splitlines()
            if x.startswith("{")]
    assert len(rows) == 66, [r["label"] for r in rows]
    *good, bad = rows
    assert "error" in bad and "Shared memory size limit exceeded" in bad["error"], bad
    for r in good:
        assert "error" not in r, r
        assert r["kernels"] == r["want"], r
        report(f"XLA sm_90 compile (deviceless, H200), {r['label']}: {r['kernels']} in {r['seconds']:.1f} s")
    families = {k for r in good for k in r["kernels"]}
    assert {"quant_matmul_int8", "quant_matmul_int4_mma", "quant_matmul_fp8", "moe_gemv_int4", "moe_gate_up_plain",
            "moe_down_glu_fp8", "windowed_draft_attention", "causal_attention", "gdn_decode_step", "gdn_verify",
            "gdn_conv_step", "gdn_rollback", "moe_router_topk", "rmsnorm_rows", "quant_gate_up_int4",
            "attention_new_rows", "quant_k_v_int4_mma", "add_rmsnorm_rows"} <= families, families


def test_targets_and_a_missing_plugin_say_what_is_wrong(monkeypatch):
    """In this process (no plugin registered, or one registered too late): the error names what to install."""
    from jax.experimental import topologies

    from qwen_mtp.errors import ArgumentError
    from qwen_mtp.tools import gpu_compile

    text = gpu_compile.target_config("H200")
    assert "core_count: 132" in text and "memory_bandwidth: 4800000000000" in text and "major: 9" in text
    # the CUDA versions XLA reads before it puts a loop in a CUDA graph (>= 12.3; a string field of the proto)
    assert 'driver_version: "12.4.0"' in text and 'runtime_version: "12.9.0"' in text, text
    with pytest.raises(ArgumentError, match="'target': expected one of \\['H100', 'H200'\\], found 'A100'"):
        gpu_compile.target_config("A100")

    def refuse(*a, **k):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    gpu_compile.devices.cache_clear()
    try:
        with pytest.raises(gpu_compile.GpuCompileUnavailable, match=r"compiling for H100: expected jax's CUDA "
                           r"plugin .* found NotImplementedError: topology not implemented .*gpu-compile"):
            gpu_compile.device("H100")
    finally:
        gpu_compile.devices.cache_clear()
