"""The lossless certificate (qwen_mtp/tools/certify.py, `python -m qwen_mtp certify`): its short form passes on the
shipped model and on random tiny architectures with drafts really accepted, and it fails when losslessness is
broken (a GDN rollback to the wrong position); bf16 near-ties are classified by the stated bound; the CLI writes
its report and exits 1 on a failing divergence, 2 on bad flags."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_flags

from qwen_mtp.tools import certify as cert
from qwen_mtp.trunk.config import parse_config
from qwen_mtp.trunk.random_weights import random_weights

REPO = Path(__file__).resolve().parents[1]
SHIPPED_ACCEPTED = 300  # seed 72 accepts 359 on the shipped model (172 + 5 + 182; 365 of 1533 in all)


def branching(tree) -> bool:
    """A Report case's tree (its repr) has a node with two children or more (not a chain-shaped tree)."""
    if tree is None:
        return False
    if tree.startswith("StaticTree"):
        return any(int(w) > 1 for w in re.findall(r"\d+", tree))
    return int(re.search(r"topk=(\d+)", tree).group(1)) > 1


def acceptance_problems(rep, least: int = SHIPPED_ACCEPTED) -> list:
    """What the sweep must show besides identity, that speculation committed drafts where the head is trained:
    on the shipped model's configurations together at least `least` accepted drafts, and some accepted in a
    branching tree's configuration and in a Wind-MTP one (so a path commit and a ring are rolled back over).
    The random architectures' heads are random: they accept little, their count is not asked for."""
    shipped = [c for c in rep.cases if c["arch"] == "model"]
    problems = []
    if sum(c["accepted"] for c in shipped) < least:
        problems.append(f"shipped model accepted {sum(c['accepted'] for c in shipped)} drafts < {least}")
    if not any(branching(c["tree"]) and c["accepted"] for c in shipped):
        problems.append("no branching tree configuration of the shipped model accepted a draft")
    if not any(c["window"] and c["accepted"] for c in shipped):
        problems.append("no Wind-MTP configuration of the shipped model accepted a draft")
    return problems


def test_short_sweep_is_identical_and_drafts_are_accepted(report):
    """Seed 72's 3 + 3 configurations: a branching static tree in a Wind-MTP window of 100, a k = 1 chain (fp8
    weights and KV), a k = 7 chain (int4 weights) on the shipped model; the three families, one configuration
    each: the MoE one under a branching tree, Qwen3-Next under a dynamic tree in a window (75 s on this CPU; seed
    161's 4 + 3 took 142 s). What the test needs of the draws is asserted, not assumed."""
    rep = cert.certify(configs=3, archs=3, cases_per_arch=1, seed=72, max_prompt=128, log=lambda s: None)
    report(rep.summary())
    assert rep.configs == 6 and rep.rows >= 6 and rep.tokens > 200
    assert rep.failing == [] and rep.divergences == [], [d.case for d in rep.divergences]
    assert rep.identical == rep.configs
    assert rep.loader_mismatches == [] and sum(rep.archs.values()) == 3, rep.archs
    assert {a.split(":")[0] for a in rep.archs} == {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}, rep.archs
    moe = [c for c in rep.cases if "moe" in c["arch"]]
    assert moe and all(c["drafted"] for c in moe), moe  # the MoE architecture's decode ran speculative rounds
    assert any(branching(c["tree"]) for c in moe) and any(c["window"] for c in rep.cases if c["arch"] == "model"), \
        rep.cases
    described = " ".join(c["case"] for c in rep.cases if c["arch"] == "model")
    assert all(f in described for f in ("quant=fp8", "quant=int4", "kv=float8_e4m3fn")), described
    assert acceptance_problems(rep) == [], (rep.summary(), rep.cases)


def test_a_broken_rollback_fails_the_certificate(monkeypatch):
    """The negative control: every GDN layer continues from its state after the FIRST verified position, whatever
    was accepted. The certificate must see it."""
    from qwen_mtp.decoding import speculative

    real = speculative.select_states
    monkeypatch.setattr(speculative, "select_states", lambda st, n: real(st, jnp.zeros_like(n)))
    jax.clear_caches()
    try:
        # seed 12's one configuration: a chain, k 7, 95 new tokens (a tree's commit does not go through
        # select_states, so the case must be a chain)
        report = cert.certify(configs=1, seed=12, max_prompt=96, quants=(None,), kv_dtypes=(None,),
                              log=lambda s: None)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert report.failing, report.summary()
    d = report.failing[0]
    assert d.plain != d.spec and d.position >= 1 and d.margin >= 0


def test_near_tie_bound():
    assert cert.near_tie(0.01, 3.0, "bfloat16") and cert.near_tie(2.0 ** -5, 0.5, "bfloat16")
    assert not cert.near_tie(0.2, 3.0, "bfloat16")  # 0.2 > 3 / 32
    assert not cert.near_tie(0.0, 3.0, "float32")  # in f32 every divergence is a bug


def test_random_architectures_randomise_every_tensor():
    rng = np.random.default_rng(3)
    kinds = set()
    for i in range(6):  # indices 0, 1, 2: one of each family; 3 .. 5 drawn
        d = cert.random_arch_config(rng, i)
        name = d.pop("_name")
        cfg = parse_config(d, name)
        kinds.add(d["model_type"])
        w = random_weights(cfg, i, passthrough=cert.PASSTHROUGH)
        for path, x in jax.tree_util.tree_flatten_with_path(w)[0]:
            x = np.asarray(x)
            assert np.unique(x).size > 1 or x.size == 1, jax.tree_util.keystr(path)  # no constant tensor
        assert w.mtp is not None
    assert kinds == {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}


def test_draws_cover_the_space():
    rng = np.random.default_rng(0)
    cases = [cert.draw_case(rng, i, 4096, np.arange(5, 2000)) for i in range(300)]
    assert {len(c.rows) for c in cases} == {1, 2, 3, 4} and {c.k for c in cases} == set(range(1, 9))
    assert {c.quant for c in cases} == set(cert.QUANTS) and {c.kv_dtype for c in cases} == set(cert.KV_DTYPES)
    assert {c.prefill_chunk for c in cases} == set(cert.PREFILL_CHUNKS)
    assert any(c.window is None for c in cases) and any(c.window and c.sinks for c in cases)
    lens = [len(r) for c in cases for r in c.rows]
    assert min(lens) == 1 and max(lens) > 256
    assert min(c.max_new for c in cases) == 1 and max(c.max_new for c in cases) > 150
    assert {s for c in cases for s in c.sources} == {"text", "random"} and {repr(c.eos) for c in cases} == {"None", "[]"}


def test_cli_report_and_bad_flags(tmp_path):
    # seed 1: one small configuration (B 2, native k 4, 9 new tokens, unquantized weights, fp8 KV)
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "qwen_mtp", "certify", "--configs", "1", "--seed", "1", "--max-prompt",
                        "40", "--report", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600, check=False,
                       env=xla_flags.defaults_env())  # at XLA's default flags, as users run it (tests/xla_flags.py)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 identical, 0 diverged" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["configs"] == 1 and rep["failing"] == 0 and rep["dtype"] == "float32"
    bad = subprocess.run([sys.executable, "-m", "qwen_mtp", "certify", "--configs", "-1"], capture_output=True,
                         text=True, cwd=REPO, timeout=300, check=False)
    assert bad.returncode == 2 and "--configs" in bad.stderr and "Traceback" not in bad.stderr
    with pytest.raises(cert.ArgumentError, match="--dtype"):
        cert.certify(configs=1, dtype="float16")


@pytest.mark.parametrize("seed,layout", [(1, "fused"), (9, "per-expert")])
def test_random_moe_architectures_go_through_the_loader_in_both_expert_layouts(seed, layout, monkeypatch):
    """Dense and MoE random architectures are written as HF checkpoints (MoE experts fused or per expert) and read
    back; the drawn and loaded weights must be bitwise equal. Negative control: a checkpoint written with each
    expert's gate and up halves swapped (the classic fused-layout mistake) is caught as a LoaderMismatch."""
    import qwen_mtp.loading.hf_write as hw

    model, name = cert.random_model(np.random.default_rng(seed), 1)  # architecture 1 is the MoE one
    assert name.endswith(f":hf-{layout}") and model.config.num_experts > 1

    real = hw.weights_to_tensors

    def swapped(weights, cfg, dtype=np.float32, experts="per-expert"):
        out = real(weights, cfg, dtype, experts)
        for key in [k for k in out if k.endswith("experts.gate_up_proj")]:
            gu = out[key]
            out[key] = np.concatenate([gu[:, gu.shape[1] // 2:], gu[:, :gu.shape[1] // 2]], axis=1)
        for key in [k for k in out if k.endswith(".gate_proj.weight") and ".experts." in k]:
            up = key.replace(".gate_proj.", ".up_proj.")
            out[key], out[up] = out[up], out[key]
        return out

    monkeypatch.setattr(hw, "weights_to_tensors", swapped)
    with pytest.raises(cert.LoaderMismatch, match=r"\.gate|\.up"):
        cert.random_model(np.random.default_rng(seed), 1)
