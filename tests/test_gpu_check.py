"""benchmarks/gpu_check (the package `python benchmarks/gpu_check` runs), the first command on a lent GPU, keeps
working: its CPU form (kernels in interpret mode at the small shapes, the end-to-end token equality of plain /
native / windowed speculative generate with streaming on and off) runs here and must report no failure; item 7
(the timed 27B slice) says it is skipped."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:  # benchmarks/ holds the gpu_check package (it is not part of qwen_mtp)
    sys.path.insert(0, BENCHMARKS)

from gpu_check import cli, timing  # noqa: E402


def test_gpu_check_runs_on_cpu(capsys):
    assert cli.main(["--interpret", "--max-new", "8"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.rstrip().splitlines()[-1].startswith("OK")
    assert "windowed k4 W64 S4" in out and "Pallas kernels []" in out  # on CPU the program holds the reference
    assert "end to end 27B slice: skipped" in out
    assert "GDN conv one head (B1 C48 float32): max_rel out, state " in out  # gdn_conv.py beside the step
    assert "RMSNorm rows R1 H1000 float32: grid (1,), max_rel " in out  # rmsnorm.py
    assert "RMSNorm rows R1 H1000 float32 pad_row (the row and its two rows): max_rel " in out
    # add_rmsnorm.py: the residual add and the norm after it, from the product's K partials
    assert "residual add + RMSNorm rows R1 H1000 from 3 K partials float32: grid (1,), max_rel " in out
    # moe_add_rmsnorm.py: a MoE block's pairs combined, added and normed
    assert "MoE combine + residual add + RMSNorm rows R1 H1000 k8 from 2 K partials float32: grid (1,), max_rel " in out
    # attention_rows.py: the queries in the attention kernel's rows and their positions, the keys and values
    assert ("attention new rows small B2 T3 heads 4/2x32 rotary 10 S2/3 float32 float32: grid (2, 2, 16), max_rel "
            in out)
    assert "pad_row: the row and zeros" in out  # the GDN step writing out_proj's two rows
    # gdn_rollback.py: both states rebuilt after a verify, the rows' inputs also as K partials
    assert "GDN rollback small B2 T4 C700 heads 3x16 float32: max_rel state " in out, out
    assert "GDN rollback small B1 T3 C384 heads 2x32 from 3 K partials float32: max_rel state " in out, out
    # the conv's row and the step's z as a quantized product's K partials (quant.linear_parts), summed in the kernel
    assert "; from 6 K partials: max_rel " in out and "; z from 6 K partials: max_rel " in out, out
    assert "dense gate / up in one launch int4 32 M1 K96 N40 float32: one launch max_rel" in out  # quant_gate_up.py


def test_gpu_check_budget_skips_and_names_what_it_skips(capsys):
    """--budget (a lease is short): a spent budget runs nothing, names every part as skipped and says so on the
    last line; a budget that is not a positive number of seconds is refused."""
    import pytest

    assert cli.main(["--interpret", "--max-new", "8", "--budget", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert "max_rel" not in out and "tokens/s" not in out  # nothing ran
    for part in ("windowed attention, small", "causal attention, small", "GDN step and verify, small",
                 "RMSNorm rows, small", "residual add + RMSNorm rows, small", "attention new rows, small",
                 "GDN rollback, small", "quantized matmul, small", "dense gate / up in one launch, small",
                 "end to end, shipped model", "tensor parallel"):
        assert f"== {part}: skipped" in out
    assert out.rstrip().splitlines()[-1].endswith("11 of 11 parts skipped for the --budget")
    from gpu_check import budget  # the run's budget ends with it: a later check in this process runs its cases
    assert not budget.out_of_time("a later check")  # (test_moe_routed calls check_moe in the same worker)
    with pytest.raises(SystemExit):
        cli.main(["--interpret", "--budget", "-3"])
    assert "--budget: expected seconds > 0, found -3" in capsys.readouterr().err


def test_gpu_check_times_calls_the_loop_cannot_hoist():
    """timing.time_call's loop (timing.chained) keeps the timed call inside the compiled while loop: the optimized
    program's loop body holds the dot. Control: the same loop with the call's input left loop-invariant has XLA
    hoist the dot out of the body, which is what a timing of nothing would look like."""
    import re

    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((64, 64), jnp.float32), jnp.ones((64, 64), jnp.bfloat16)
    f = jax.jit(lambda x, w: jnp.tanh(x @ w.astype(jnp.float32)))

    def body_has_dot(hlo):
        bodies = re.findall(r"while\([^)]*\).*?body=(%?[\w.\-]+)", hlo)
        assert bodies, "no while loop in the program"
        comps = dict(re.findall(r"\n(%?[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
        seen, todo = set(), [b.lstrip("%") for b in bodies]
        while todo:  # the body and every computation it calls (fusions)
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            text = next((v for k, v in comps.items() if k.lstrip("%") == name), "")
            if re.search(r"\bdot\(|custom-call\(", text):
                return True
            todo += [c.lstrip("%") for c in re.findall(r"(?:calls|to_apply|body)=(%?[\w.\-]+)", text)]
        return False

    chained = timing.chained(f, (x, w), 7).lower(x, w).compile().as_text()
    assert body_has_dot(chained)
    invariant = jax.jit(lambda x, w: jax.lax.fori_loop(0, 7, lambda i, c: c + f(x, w)[0, 0], 0.0))
    assert not body_has_dot(invariant.lower(x, w).compile().as_text())


def test_gpu_check_checks_every_decode_plan_alternative(capsys):
    """--quant-only's plan sweep (quant.check_quant_plans): each of quant_gemv.alternatives' plans (a lane's words
    x K's parts) runs and matches the reference (interpret mode here); the GPU run times them."""
    from gpu_check import quant

    from kernels_pallas import quant_gemv as gemv

    (case,) = quant.QUANT_PLANS_SMOKE
    kind, fmt, M, K, N, _ = case
    alternatives = gemv.alternatives(M, K, N, kind, (fmt, 1), words=quant.PLAN_WORDS)
    assert len(alternatives) >= 4 and {w for w, *_ in alternatives} == set(quant.PLAN_WORDS), alternatives
    assert quant.check_quant_plans([case], interpret=True, timings=False) == 0
    out = capsys.readouterr().out
    assert out.count("max_rel") == len(alternatives) and "FAIL" not in out, out


def test_only_flags_combine_numerics_first(capsys):
    """The --*-only flags combine into one command (a short lease): every named part's numerics sections, then
    each part's main timed section, then the rest (the --interpret form has none but tp / e2e27b's); a spent
    budget names each as skipped."""
    def skipped(argv):
        assert cli.main(argv + ["--budget", "1e-9"]) == 0
        return [line[3:-len(": skipped, the --budget is spent")] for line in capsys.readouterr().out.splitlines()
                if line.startswith("== ") and line.endswith("skipped, the --budget is spent")]

    small = ["quantized matmul, small", "decode kernel plan alternatives, small",
             "dense gate / up in one launch, small", "MoE routed experts, small",
             "MoE experts' SwiGLU, small", "MoE experts and the shared expert, small", "MoE router top-k, small",
             "MoE prefill paths, small", "MoE routed plan alternatives, small"]
    assert skipped(["--interpret", "--moe-only", "--quant-only", "--long-only"]) == small + ["causal attention, small"]
    assert skipped(["--moe-only", "--quant-only"]) == small + [  # the device form (nothing runs: the budget is spent)
        "quantized matmul, 27B matrices, timed", "MoE routed experts, 35B-A3B experts, timed",  # main timings first
        "dense gate / up in one launch, 27B and 35B-A3B shared expert, timed",
        "decode kernel plan alternatives, 27B matrices, timed", "MoE experts' SwiGLU, 35B-A3B experts, timed",
        "MoE experts and the shared expert, 35B-A3B, timed", "MoE router top-k, real routers, timed",
        "MoE routed plan alternatives, 35B-A3B experts, timed", "MoE prefill paths, 35B-A3B experts, timed"]
