"""The lossless certificate: plain greedy against speculative greedy over random configurations.

    python -m qwen_mtp certify [--model DIR] [--configs N] [--archs N] [--seed S] [--dtype float32|bfloat16]
                               [--max-prompt 512] [--report FILE]

Each configuration draws, from one seeded generator: a batch of 1..4 rows of mixed lengths (1..max_prompt, log-
uniform; cut from held-out text where the model folder is the shipped model, random ids otherwise, and both mixed
in a batch), k in 1..8, native drafts or Wind-MTP (window 1..128, sinks 0..8), the config's EOS ids or none,
max_new_tokens 1..200, a prefill chunk (16..256), the weight format (as loaded, int8, int4 or fp8, quantized as it
loads), the KV dtype (the compute dtype or float8_e4m3fn) and the drafts (a chain, a static or a dynamic tree:
`draw_tree`). It runs plain greedy (with the logits each token was chosen from) and speculative greedy on the same
model and compares every row token by token.

A divergence is reported with its configuration, row, position and the trunk's top1 - top2 logit margin there
(from the plain run). In float32 any divergence is a bug and fails the run. In bfloat16 the k + 1 rows of a
verify are computed in one product where plain decoding computes one row at a time, so the logits may differ by
rounding and a near-tie may flip: a divergence whose margin is at most NEAR_TIE_BF16 (relative to the top logit,
see `near_tie`) is classified a near-tie and reported; any other fails the run.

--archs N adds N random tiny architectures (dense, MoE, Qwen3-Next: the first three one of each; layer patterns,
head counts, GDN head counts and sizes, partial RoPE, tied or untied embeddings, a random MTP head leaning on the
trunk hidden so drafts are accepted sometimes), every tensor randomised (norms, A_log, dt_bias and conv taps
included; qwen_mtp/trunk/random_weights.py), each run on a few configurations of random ids (--cases-per-arch,
default 2). Dense and MoE architectures go through a Hugging Face checkpoint on disk (MoE experts per expert or
fused) and the loader, which must give back the drawn weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from qwen_mtp.errors import ArgumentError
from qwen_mtp.head.tree import MAX_NODES, DynamicTree, StaticTree

NEAR_TIE_BF16 = 2.0 ** -5  # margin / max(1, |top1 logit|) at or below which a bf16 divergence is a near-tie
PREFILL_CHUNKS = (16, 32, 64, 128, 256)
QUANTS = (None, "int8", "int4", "fp8")
KV_DTYPES = (None, "float8_e4m3fn")
# the random architectures' MTP heads: passthrough * I on mtp.fc's trunk-hidden half (random_weights), so the head
# leans on the trunk hidden and drafts are accepted sometimes
PASSTHROUGH = 3.0


@dataclasses.dataclass
class Case:
    """One configuration: what generate is called with (plain and speculative)."""
    index: int
    rows: list  # of np.int64 arrays
    sources: list  # per row: "text" or "random"
    max_new: int
    k: int
    window: int | None
    sinks: int
    eos: list | None  # None: the config's EOS ids; []: none
    prefill_chunk: int
    quant: str | None
    kv_dtype: str | None
    arch: str = "model"
    tree: object = None  # None: a chain of k drafts; a head/tree.py StaticTree or DynamicTree of depth k

    def describe(self) -> str:
        lens = ",".join(str(len(r)) for r in self.rows)
        win = "native" if self.window is None else f"W{self.window} S{self.sinks}"
        return (f"#{self.index} [{self.arch}] B={len(self.rows)} lens={lens} ({'/'.join(self.sources)}) k={self.k} "
                f"{win} eos={'cfg' if self.eos is None else 'off'} new={self.max_new} chunk={self.prefill_chunk} "
                f"quant={self.quant or 'none'} kv={self.kv_dtype or 'compute'}"
                + ("" if self.tree is None else f" tree={self.tree}"))


@dataclasses.dataclass
class Divergence:
    case: str
    row: int
    position: int
    plain: int
    spec: int
    margin: float
    near_tie: bool


@dataclasses.dataclass
class Report:
    dtype: str
    configs: int = 0
    identical: int = 0
    rows: int = 0
    tokens: int = 0
    drafted: int = 0  # draft positions verified: rounds x k (a tree's depth k: its nodes are not counted)
    accepted: int = 0
    cases: list = dataclasses.field(default_factory=list)  # per configuration: case, arch, window, tree, drafted, ...
    divergences: list = dataclasses.field(default_factory=list)
    archs: dict = dataclasses.field(default_factory=dict)  # "qwen3_5_moe_text:hf-fused" -> architectures run
    loader_mismatches: list = dataclasses.field(default_factory=list)  # messages; each fails the run
    seconds: float = 0.0

    @property
    def failing(self) -> list:
        return [d for d in self.divergences if not d.near_tie]

    @property
    def failed(self) -> bool:
        return bool(self.failing or self.loader_mismatches)

    def summary(self) -> str:
        near = len(self.divergences) - len(self.failing)
        from qwen_mtp.decoding.stats import fmt
        rate = fmt(self.accepted / self.drafted) if self.drafted else "-"
        return (f"certify ({self.dtype}): {self.configs} configurations, {self.rows} rows, {self.tokens} tokens: "
                f"{self.identical} identical, {self.configs - self.identical} diverged "
                f"({len(self.failing)} failing, {near} near-ties); drafts accepted {self.accepted}/{self.drafted} "
                f"({rate}); {self.seconds:.0f} s"
                + (f"; {sum(self.archs.values())} random architectures ("
                   + ", ".join(f"{k} {v}" for k, v in sorted(self.archs.items())) + ")" if self.archs else "")
                + (f"; {len(self.loader_mismatches)} LOADER MISMATCHES" if self.loader_mismatches else ""))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["failing"] = len(self.failing)
        return d


def near_tie(margin: float, top1: float, dtype: str) -> bool:
    """bf16 only: a flip at a margin within NEAR_TIE_BF16 of the top logit's scale is a near-tie."""
    return dtype == "bfloat16" and margin <= NEAR_TIE_BF16 * max(1.0, abs(top1))


# ------------------------------------------------------------------------------------------------- drawing cases
def _log_uniform(rng, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)) - 1e-9)))))


def draw_case(rng, index: int, vocab_size: int, text_ids=None, *, max_prompt: int = 512, quants=QUANTS,
              kv_dtypes=KV_DTYPES, arch: str = "model") -> Case:
    B = int(rng.integers(1, 5))
    rows, sources = [], []
    for _ in range(B):
        L = _log_uniform(rng, 1, max_prompt)
        if text_ids is not None and len(text_ids) > L and rng.random() < 0.6:
            start = int(rng.integers(0, len(text_ids) - L))
            rows.append(np.asarray(text_ids[start:start + L], np.int64))
            sources.append("text")
        else:
            rows.append(rng.integers(1, vocab_size, L).astype(np.int64))
            sources.append("random")
    windowed = rng.random() < 0.4
    max_new, k = _log_uniform(rng, 1, 200), int(rng.integers(1, 9))  # this order: a seed's draws from before trees
    return Case(index=index, rows=rows, sources=sources, max_new=max_new,
                k=k, window=_log_uniform(rng, 1, 128) if windowed else None,
                sinks=int(rng.integers(0, 9)) if windowed and rng.random() < 0.5 else 0,
                eos=None if rng.random() < 0.5 else [], prefill_chunk=int(rng.choice(PREFILL_CHUNKS)),
                quant=quants[int(rng.integers(0, len(quants)))], kv_dtype=kv_dtypes[int(rng.integers(0, len(kv_dtypes)))],
                arch=arch, tree=draw_tree(index, rows, k))


def draw_tree(index: int, rows, k: int):
    """A chain (60%), a static tree of widths 1..3 at the first two depths then a chain (20%), or a dynamic tree of
    topk 1..3, any budget (20%); from a generator of the case's own, so `rng` draws what it drew before trees."""
    r = np.random.default_rng([40, index, k] + [len(x) for x in rows])
    u = r.random()
    if u < 0.6:
        return None
    if u < 0.8:
        widths = [int(r.integers(1, 4)) for _ in range(min(k, 2))] + [1] * max(k - 2, 0)
        while int(sum(np.cumprod(widths))) > MAX_NODES:
            widths[int(np.argmax(widths))] -= 1
        return StaticTree(tuple(widths))
    topk = int(r.integers(1, 4))
    return DynamicTree(depth=k, topk=topk, budget=int(r.integers(1, min(topk + (k - 1) * topk ** 2, MAX_NODES) + 1)))


# ---------------------------------------------------------------------------------------------- running a case
def run_case(model, case: Case, report: Report) -> list:
    """Plain and speculative greedy on `model` (already in the case's weight format); appends to the report."""
    import qwen_mtp

    spec = qwen_mtp.SpecConfig(k=case.k, window=case.window, sinks=case.sinks, tree=case.tree)
    kw = {"eos_token_id": case.eos, "prefill_chunk": case.prefill_chunk, "kv_dtype": case.kv_dtype}
    plain = qwen_mtp.generate(model, case.rows, case.max_new, return_logits=True, **kw)
    fast = qwen_mtp.generate(model, case.rows, case.max_new, spec=spec, **kw)
    found = []
    for b in range(len(case.rows)):
        n_p, n_s = int(plain.lengths[b]), int(fast.lengths[b])
        a, s = plain.tokens[b, :n_p], fast.tokens[b, :n_s]
        n = min(n_p, n_s)
        diff = np.flatnonzero(a[:n] != s[:n])
        pos = int(diff[0]) if len(diff) else (n if n_p != n_s else None)
        if pos is not None:
            pos_logits = plain.logits[b, min(pos, n_p - 1)]
            top2 = np.sort(pos_logits)[-2:]
            margin = float(top2[1] - top2[0])
            found.append(Divergence(case.describe(), b, pos, int(a[pos]) if pos < n_p else -1,
                                    int(s[pos]) if pos < n_s else -1, margin,
                                    near_tie(margin, float(top2[1]), report.dtype)))
        report.rows += 1
        report.tokens += n_p
    st, drafted, accepted = fast.stats, 0, 0
    if st.accept_hist is not None and st.rounds:  # hist[n]: rounds that accepted n drafts (a tree: its path's n)
        hist = np.asarray(st.accept_hist)
        drafted, accepted = int(st.rounds) * case.k, int((hist * np.arange(len(hist))).sum())
    report.drafted, report.accepted = report.drafted + drafted, report.accepted + accepted
    report.cases.append({"case": case.describe(), "arch": case.arch, "window": case.window, "drafted": drafted,
                         "tree": None if case.tree is None else repr(case.tree), "accepted": accepted})
    report.configs += 1
    report.identical += not found
    report.divergences.extend(found)
    return found


# ---------------------------------------------------------------------------------------- random architectures
def random_arch_config(rng, index: int) -> dict:
    """A random tiny config.json (dense / MoE / Qwen3-Next) with an MTP head. Architectures 0, 1, 2 are one of
    each family (so any run of three or more covers all three); later ones draw the family too."""
    drawn = int(rng.integers(0, 3))  # drawn for every index, so the rest of the stream does not depend on it
    kind = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")[index if index < 3 else drawn]
    nh, nkv = [(2, 1), (4, 2), (4, 1), (4, 4), (6, 2)][int(rng.integers(0, 5))]
    hd = int(rng.choice([8, 16]))
    nk, nv = [(1, 1), (1, 2), (2, 2), (2, 4), (1, 3)][int(rng.integers(0, 5))]
    n_layers = int(rng.integers(2, 7))
    cfg = {"model_type": kind, "hidden_size": int(rng.choice([16, 32, 48])), "num_hidden_layers": n_layers,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "linear_num_key_heads": nk, "linear_num_value_heads": nv,
           "linear_key_head_dim": int(rng.choice([8, 16])), "linear_value_head_dim": int(rng.choice([8, 16])),
           "linear_conv_kernel_dim": int(rng.integers(2, 5)), "vocab_size": int(rng.choice([61, 97, 128])),
           "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096,
           "tie_word_embeddings": bool(rng.random() < 0.5), "eos_token_id": 0,
           "rope_parameters": {"rope_type": "default", "rope_theta": float(rng.choice([1e4, 1e5])),
                               "partial_rotary_factor": float(rng.choice([0.25, 0.5, 1.0]))}}
    if rng.random() < 0.5:
        cfg["full_attention_interval"] = int(rng.integers(1, 5))
    else:  # an explicit pattern, at least one layer of each kind where there is room
        types = ["linear_attention" if rng.random() < 0.6 else "full_attention" for _ in range(n_layers)]
        types[int(rng.integers(0, n_layers))] = "full_attention"
        cfg["layer_types"] = types
    if kind == "qwen3_5_text":
        cfg["intermediate_size"] = int(rng.choice([32, 48, 64]))
    else:
        E = int(rng.choice([2, 4, 8]))
        cfg.update(num_experts=E, num_experts_per_tok=int(rng.integers(1, min(E, 3) + 1)),
                   moe_intermediate_size=int(rng.choice([8, 16])), shared_expert_intermediate_size=int(rng.choice([16, 24])))
        if kind == "qwen3_next":
            cfg.update(intermediate_size=int(rng.choice([32, 48])), decoder_sparse_step=int(rng.integers(1, 3)),
                       norm_topk_prob=True)
    cfg["_name"] = f"arch{index}:{kind}:L{n_layers}:h{cfg['hidden_size']}:nh{nh}/{nkv}:gdn{nk}/{nv}:" \
                   f"{'tied' if cfg['tie_word_embeddings'] else 'untied'}"
    return cfg


def random_model(rng, index: int, dtype="float32"):
    """A random architecture as a Model. Qwen3.5 dense and MoE architectures are written as a Hugging Face
    checkpoint (MoE experts per expert or fused, at random) and read back through the loader, which must return
    exactly the weights that were drawn (LoaderMismatch otherwise); Qwen3-Next is built in memory (the writer
    has no Qwen3-Next layout). The name says which: `:mem`, `:hf`, `:hf-per-expert` or `:hf-fused`."""
    import tempfile

    import qwen_mtp
    from qwen_mtp.trunk.config import parse_config
    from qwen_mtp.trunk.random_weights import random_weights

    d = random_arch_config(rng, index)
    name = d.pop("_name")
    cfg = parse_config(d, f"<certify {name}>")
    weights = random_weights(cfg, int(rng.integers(0, 2 ** 31)), dtype, passthrough=PASSTHROUGH)
    if cfg.model_type == "qwen3_next":
        return qwen_mtp.Model(config=cfg, weights=weights, path=f"<random {name}:mem>", dtype=dtype,
                              quant=None), name + ":mem"
    from qwen_mtp.loading.hf_write import EXPERT_LAYOUTS, save_checkpoint

    layout = EXPERT_LAYOUTS[int(rng.integers(0, 2))] if cfg.model_type == "qwen3_5_moe_text" else None
    name += f":hf-{layout}" if layout else ":hf"
    with tempfile.TemporaryDirectory(prefix="qwen-mtp-certify-") as tmp:
        save_checkpoint(tmp, weights, cfg, d, np.float32, experts=layout or "per-expert")
        model = qwen_mtp.load(tmp, dtype=dtype)
    check_same_weights(weights, model.weights, name)
    return model, name


class LoaderMismatch(AssertionError):
    """The loader did not return the weights a random architecture's checkpoint was written from."""


def check_same_weights(drawn, loaded, name: str) -> None:
    import jax

    a, tree_a = jax.tree_util.tree_flatten_with_path(drawn)
    b, tree_b = jax.tree_util.tree_flatten_with_path(loaded)
    if tree_a != tree_b:
        raise LoaderMismatch(f"{name}: the loaded weights' structure {tree_b} is not the drawn {tree_a}")
    for (path, x), (_, y) in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            raise LoaderMismatch(f"{name}: tensor {jax.tree_util.keystr(path)} read back as {y.dtype}{list(y.shape)}"
                                 f" differs from the drawn {x.dtype}{list(x.shape)}")


# -------------------------------------------------------------------------------------------------- the sweep
def certify(model_path=None, *, configs: int = 50, archs: int = 0, seed: int = 0, dtype: str = "float32",
            max_prompt: int = 512, cases_per_arch: int = 2, log=print, quants=QUANTS, kv_dtypes=KV_DTYPES,
            report: Report | None = None, on_case=None) -> Report:
    """Run the sweep; returns the Report (its `failing` list is what fails a run). `report`: a Report to fill
    (the caller keeps what ran if the sweep is interrupted); on_case(report) is called after every case."""
    import qwen_mtp
    from qwen_mtp.loading.folder import default_model_path, load_tokenizer

    if dtype not in ("float32", "bfloat16"):
        raise ArgumentError("--dtype", "float32 or bfloat16", repr(dtype))
    for name, v, lo in (("--configs", configs, 0), ("--archs", archs, 0), ("--max-prompt", max_prompt, 1),
                        ("--cases-per-arch", cases_per_arch, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ArgumentError(name, f"an integer >= {lo}", repr(v))
    rng = np.random.default_rng(seed)
    report = Report(dtype=dtype) if report is None else report
    t0 = time.perf_counter()

    def done_one():
        # each case compiles programs of its own shapes: drop them (jax's caches, the program cache's memo) so a
        # long sweep's memory stays flat; the persistent caches on disk keep them for a rerun
        import jax

        from qwen_mtp.compiling import program_cache
        jax.clear_caches()
        program_cache._memo.clear()
        report.seconds = time.perf_counter() - t0
        if on_case is not None:
            on_case(report)

    folder = Path(model_path) if model_path is not None else default_model_path()
    if configs:
        text_ids = _held_out_ids(folder, load_tokenizer)
        models = {}
        base = qwen_mtp.load(folder, dtype=dtype)
        if base.weights.mtp is None:
            raise ArgumentError("--model", "a checkpoint with an MTP head (mtp.* tensors)", str(folder))
        models[None] = base
        log(f"model {folder} ({dtype}), {configs} configurations, seed {seed}"
            + (f", held-out text ({len(text_ids)} ids)" if text_ids is not None else ", random ids"))
        for i in range(configs):
            case = draw_case(rng, i, base.config.vocab_size, text_ids, max_prompt=max_prompt, quants=quants,
                             kv_dtypes=kv_dtypes)
            if case.quant not in models:
                models[case.quant] = qwen_mtp.load(folder, dtype=dtype, quant=case.quant)
            _run_logged(models[case.quant], case, report, log)
            done_one()
    for a in range(archs):
        try:
            model, name = random_model(rng, a, dtype)
        except LoaderMismatch as e:
            report.loader_mismatches.append(str(e))
            log(f"  LOADER MISMATCH {e}")
            continue
        key = name.split(":")[1] + ":" + name.split(":")[-1]
        report.archs[key] = report.archs.get(key, 0) + 1
        for j in range(cases_per_arch):
            case = draw_case(rng, report.configs, model.config.vocab_size, None, max_prompt=min(max_prompt, 64),
                             quants=(None,), kv_dtypes=kv_dtypes, arch=name)
            _run_logged(model, case, report, log)
            done_one()
    report.seconds = time.perf_counter() - t0
    log(report.summary())
    return report


def _run_logged(model, case, report, log):
    t = time.perf_counter()
    found = run_case(model, case, report)
    log(f"  {'DIVERGED' if found else 'ok'} {case.describe()} ({time.perf_counter() - t:.1f} s)")
    for d in found:
        log(f"  DIVERGED {'(near-tie) ' if d.near_tie else ''}{d.case}: row {d.row} position {d.position}: plain "
            f"{d.plain}, speculative {d.spec}, trunk margin {d.margin:.3g}")


def _held_out_ids(folder: Path, load_tokenizer):
    """Token ids of the shipped model's held-out training files (checkpoints/corpus.HELD_OUT), when `folder` has
    a tokenizer and the files exist on this interpreter; None otherwise."""
    try:
        from checkpoints.corpus import held_out_ids
        return held_out_ids(load_tokenizer(str(folder)))
    except Exception:  # noqa: BLE001 - no tokenizer or no files: random ids only
        return None


def write_report(report: Report, path) -> None:
    """The report as JSON, written atomically (a temporary file renamed into place)."""
    import os
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=".tmp-certify-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report.to_json(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
