"""--k auto: every candidate is timed on the machine and the fastest is kept (plain decoding included)."""

import io

import numpy as np

import qwen_mtp
from qwen_mtp.decoding.auto_k import pick_k


def test_pick_k_times_every_candidate_and_returns_the_fastest(ckpt):
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    log = io.StringIO()
    ids = np.random.RandomState(0).randint(0, 97, 12)
    best = pick_k(model, ids, 24, {}, lambda k: qwen_mtp.SpecConfig(k=k), candidates=(1, 2), log=log)
    line = log.getvalue()
    assert "plain:" in line and "k=1:" in line and "k=2:" in line
    times = {tok.split(":")[0]: float(tok.split(":")[1]) for tok in line.split("TPOT ms")[1].split("->")[0].split("  ")
             if ":" in tok}
    fastest = min(times, key=times.get)
    assert (best is None and fastest == "plain") or fastest == f"k={best}"
