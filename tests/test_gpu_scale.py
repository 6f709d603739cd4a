"""benchmarks/gpu_scale (the full-depth models on one GPU), its short form: tiny configs on the CPU, the same parts
(random weights made on the device, the plain step and the speculative rounds called directly at random-filled
caches with the positions set, the bytes they read, the published-AL TPOT, the Wind-MTP paper's table, the cached
start in a second process), and the budget / memory refusals that name what they skip."""

import re
import sys
from pathlib import Path

import jax
import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # benchmarks/ holds the gpu_scale package (it is not part of qwen_mtp)
    sys.path.insert(0, BENCHMARKS)

from gpu_scale import cli, reads


def test_short_form_runs_every_part(capsys):
    """The MoE model in int4 (the path with experts and the traced quantizer), k = 1, two contexts; the draft
    vocabulary's rounds left out here (two more compiles; benchmarks/results' short run has them)."""
    before = jax.config.jax_compilation_cache_dir
    assert cli.main(["--short", "--runs", "35B-A3B-int4", "--k", "1", "--contexts", "64,256", "--draft-vocab", "0",
                     "--loop-graph"]) == 0
    out = capsys.readouterr().out
    # the fresh compile cache it made (its second process read it) is gone, and this process's own is back
    made = Path(re.search(r"compile cache (\S+)", out).group(1))
    assert made.name.startswith("gpu_scale_jax_cache_") and not made.exists(), made
    assert jax.config.jax_compilation_cache_dir == before and before, before
    assert "FAIL" not in out and out.rstrip().splitlines()[-1].startswith("OK: 0 failures")
    assert re.search(r"launch probe: a chain of \d+ tiny dependent kernels a loop iteration .*: [\d.]+ us a kernel",
                     out)
    assert "== 35B-A3B-int4: 4 layers + MTP head, int4 g128 (lm_head, MTP head too) weights" in out
    for label in ("plain", "k1 native", "k1 windowed W32 S4"):
        assert f"  {label}: compiled in " in out, label
    kernels = {int(m) for m in re.findall(r"compiled in [\d.]+ s, (\d+) kernels \((?:fusion|custom-call) \d+[^)]*\) a "
                                          r"(?:step|round)", out)}
    assert len(kernels) >= 2 and min(kernels) > 20, kernels  # a 4-layer step launches dozens; a round more
    assert "draft vocab" not in out and "(again" not in out
    # --loop-graph: the plain step and the native round timed again with graphs.LOOP_GRAPH, beside the default
    for label in ("plain", "k1 native"):
        line = re.search(rf"^  {label}, --loop-graph: compiled in [\d.]+ s, no CUDA graphs on cpu; per "
                         rf"(?:step|round) 64: [\d.]+ ms \(([\d.]+) of the default's\), 256: .*$", out, re.M)
        assert line and float(line.group(1)) > 0, (label, out)
    assert "windowed W32 S4, --loop-graph" not in out
    for ctx in (64, 256):
        assert f"35B-A3B-int4 at {ctx} cached positions" in out
    assert out.count("plain TPOT") == 2 and "with routed experts only" in out
    assert out.count("AL 1.93: ") == 4  # 2 round kinds x 2 contexts, TPOT at the published AL
    assert "Wind-MTP paper's per-step table" in out and "ours, 35B-A3B-int4 at 256 cached positions, k = 1" in out
    assert "cached start: a second process lowered 3 programs of 35B-A3B-int4" in out


def test_budget_and_memory_skip_and_name_what_they_skip(capsys):
    assert cli.main(["--short", "--runs", "27B-bf16,35B-A3B-bf16", "--memory", "1e5", "--no-cached-start"]) == 0
    out = capsys.readouterr().out
    assert "27B-bf16 at 1024 positions: skipped, needs" in out and "27B-bf16 at 64 positions: skipped" in out
    assert "compiled in" not in out and "6 parts skipped for the --budget or memory" in out.splitlines()[-1]
    assert cli.main(["--short", "--runs", "27B-bf16", "--budget", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert "== 27B-bf16: plain, k3 native, k3 windowed W32 S4 skipped for the --budget" in out
    assert "== 27B-bf16: k3 native draft vocab 128, " in out and "compiled in" not in out
    with pytest.raises(SystemExit):
        cli.main(["--budget", "-3"])
    assert "--budget: expected seconds > 0, found -3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--short", "--list-kernels"])
    assert "--list-kernels: lists a compiled program's kernels; needs --compile-for" in capsys.readouterr().err


def test_reads_charge_an_moe_only_its_routed_experts():
    """The roofline's bytes: a plain step of an MoE reads top_k / E of its experts, a round of k + 1 rows up to
    (k + 1) top_k of them; the KV read grows with the position, the Wind-MTP head's stops at sinks + window."""
    from gpu_scale.models import abstract_weights, config

    cfg = config("Qwen3.5-35B-A3B", True, 4096)
    parts = reads.weight_parts(abstract_weights(cfg, "bfloat16", None), cfg)
    assert parts["experts"] > 0 and parts["head_experts"] > 0
    step = reads.step_reads(parts, cfg, 1, 100, 2)
    assert step["weights"] == parts["trunk"] + parts["experts"] * 2 / 8 + parts["lm_head"]
    assert reads.routed(parts["experts"], cfg, 4) == parts["experts"]  # 4 rows x top 2 = all 8 experts
    native = reads.round_reads(parts, cfg, 1, 3000, 2, 3)
    windowed = reads.round_reads(parts, cfg, 1, 3000, 2, 3, window=32, sinks=4)
    per = reads.kv_per_position(cfg, 2)
    assert native["kv"] - windowed["kv"] == 3 * (3001 - 36) * per
    assert native["weights"] == windowed["weights"]


# thunk sequences as XLA 0.10.2 dumps them for an H200 (gpu_compile, deviceless), cut to their shape: the default
# (the loop on the host, its body one command buffer) and graphs.LOOP_GRAPH (the loop inside the command buffer)
BODY_GRAPH = """001: kCopy  [source       | next=135 (2)] kCopy
002: kWhile [source       | sink        ]
condition:
    003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        004: kCustomKernel [source       | next=132 (128)] input_reduce_fusion_13 grid: [1, 1, 1]
        007: kCopy         [prev=006 (1) | next=010 (3)  ] kCopy
        019: kCustomKernel [prev=018 (1) | next=020 (1)  ] gdn_decode_step grid: [1, 32, 1]
"""
LOOP_GRAPH = """000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=135 (2)] kCopy
    002: kWhile [source       | sink        ]
condition:
        003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
      body:
        004: kCustomKernel [source       | next=132 (128)] input_reduce_fusion_13 grid: [1, 1, 1]
        007: kCopy         [prev=006 (1) | next=010 (3)  ] kCopy
"""


def test_graphs_read_where_the_decode_loop_runs():
    """graphs.structure: the default dump keeps the loop on the host with its body in one graph (the condition's
    kernel outside); LOOP_GRAPH's puts the loop itself in the graph; thunks before the loop are not counted; a
    body with no command buffer is all outside."""
    from gpu_scale import graphs

    body = graphs.structure(BODY_GRAPH)
    assert body == {"loop_in_graph": False, "graphs": 1, "in_graphs": 3, "outside": 1, "host_loops": 0}, body
    assert graphs.describe(body) == ("the loop on the host (its predicate read back each step), 3 of its 4 thunks "
                                     "in 1 graph a step")
    loop = graphs.structure(LOOP_GRAPH)
    assert loop == {"loop_in_graph": True, "graphs": 0, "in_graphs": 3, "outside": 0, "host_loops": 0}, loop
    assert graphs.describe(loop).startswith("the whole loop one CUDA graph (a conditional node), 3 thunks")
    bare = graphs.structure(BODY_GRAPH.replace("    000: kCommandBuffer [source | sink]\n", ""))
    assert bare == {"loop_in_graph": False, "graphs": 0, "in_graphs": 0, "outside": 4, "host_loops": 0}, bare
    assert graphs.structure("001: kCopy [source | sink] kCopy\n") == {}
    assert graphs.describe({}) == "no loop in the program"


def test_launches_count_a_loops_kernels():
    """launches.per_iteration: the decode loop's body and condition, a nested loop's body times its known trip
    count. Two programs that differ only in the nested loop's trips (3, 6) differ by 3 x the nested body and
    condition."""
    import jax
    import jax.numpy as jnp
    from gpu_scale import launches

    def text(trips):
        def f(x, w, n):
            def body(c):
                i, x = c
                x = jax.lax.fori_loop(0, trips, lambda j, y: jnp.sin(y @ w), jnp.tanh(x @ w))
                return i + 1, x
            return jnp.exp(jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1])
        return jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((8, 8)), 5).compile().as_text()

    three, six = launches.per_iteration(text(3)).total(), launches.per_iteration(text(6)).total()
    inner = (six - three) / 3  # the nested loop's kernels an iteration (on this CPU 4)
    assert inner == int(inner) >= 2 and three - 3 * inner >= 3, (three, six)  # + the outer body's own, once
    assert launches.per_iteration("ENTRY %main (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}").total() == 0
    assert launches.describe(launches.per_iteration(text(3))).startswith(f"{three} kernels (fusion ")


def test_plain_step_line_reads_the_gap_against_kernels_and_the_launch_probe(capsys):
    """report.model_table on a device of known peak: the time beyond the bytes' time, per kernel, and what the
    kernels cost at the launch probe's time a kernel; compile_only's launch budget for a step at 85% of peak."""
    from gpu_scale import report
    from gpu_scale.compile_only import launch_budget_us
    from gpu_scale.models import abstract_weights, config

    cfg = config("Qwen3.5-27B", True, 4096)
    parts = reads.weight_parts(abstract_weights(cfg, "bfloat16", None), cfg)
    total = sum(reads.step_reads(parts, cfg, 1, 64, 2).values())
    bw = 1e9  # 1 GB/s: the step's bytes take total ns; it is timed 0.5 ms beyond them
    res = {"cfg": cfg, "parts": parts, "plain": {64: total / bw + 5e-4}, "rounds": {}, "kernels": {"plain": 100}}
    report.model_table("27B-bf16", res, [64], [3], {}, 1, bw, "bfloat16", per_kernel=2e-6)
    out = capsys.readouterr().out
    assert "100 kernels a step (launches.py, from the compiled HLO): the step takes 0.500 ms beyond its bytes' " \
           "time at peak, 5.00 us a kernel; at the launch probe's 2.00 us a kernel they take 0.200 ms" in out, out
    report.model_table("27B-bf16", res, [64], [3], {}, 1, bw, "bfloat16")
    assert "launch probe" not in capsys.readouterr().out
    # 10 ms of bytes at 85%: 11.765 ms, so 1.765 ms for 1000 kernels
    assert abs(launch_budget_us(10e-3 * 4.8e12, 4.8e12, 1000) - 1.7647) < 1e-3
