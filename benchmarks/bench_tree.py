"""Tree drafts against the chain (issue 40), one run, CPU.

    python benchmarks/bench_tree.py [--part shipped,0p8b,gdn] [--prompts 4] [--prompt-len 128] [--new 64]

shipped  The shipped model (checkpoints/qwen3_5_small, float32) on held-out prompts (eval_small's way: windows
         of the held-out stream the tokenizer and the model never saw, drawn with seed 0), greedy, the prompts as
         one batch. At equal numbers of verified tokens per round (the verify's rows: k + 1 for the chain, nodes
         + 1 for a tree), the chain against static and dynamic trees: AL (tokens per round, stats.acceptance_
         length), decode tokens/s (each generate compiled by a first call, timed on a second), the acceptance per
         sibling rank. Every run is checked equal to plain greedy.
0p8b     One round in plain steps at the Qwen3.5-0.8B shape (random bf16 weights, a 32768-id draft vocabulary as
         benchmarks/bench_0p8b.py): decode time / rounds per row over a plain step's TPOT. Random weights accept
         nothing, so this is the cost side only.
gdn      The tree GDN core at the 0.8B GDN shape (16 value heads of 128 x 128) for a tree: the tree-shaped chunk
         form (tree_verify.tree_core, what the verify runs) against per-path evaluation (per_path_core: each
         root-to-leaf path as its own chain verify), median of timed calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _specs(budgets):
    """[(verified rows, label, SpecConfig)] per budget of draft nodes."""
    from qwen_mtp import SpecConfig
    from qwen_mtp.head.tree import DynamicTree, StaticTree

    out = []
    for nodes in budgets:
        out.append((nodes + 1, f"chain k={nodes}", SpecConfig(k=nodes)))
        if nodes == 4:
            out.append((5, "static (2, 1)", SpecConfig(k=2, tree=StaticTree((2, 1)))))
            out.append((5, "dynamic depth 3 topk 2 budget 4", SpecConfig(k=3, tree=DynamicTree(3, 2, 4))))
        if nodes == 8:
            out.append((9, "static (2, 1, 1, 1)", SpecConfig(k=4, tree=StaticTree((2, 1, 1, 1)))))
            out.append((9, "dynamic depth 5 topk 2 budget 8", SpecConfig(k=5, tree=DynamicTree(5, 2, 8))))
    return out


def _twice(model, prompts, new, spec):
    import qwen_mtp

    qwen_mtp.generate(model, prompts, new, spec=spec, eos_token_id=[])
    return qwen_mtp.generate(model, prompts, new, spec=spec, eos_token_id=[])


def shipped(args):
    import qwen_mtp
    from checkpoints.eval_small import held_out_ids
    from qwen_mtp.loading.folder import load_tokenizer

    path = ROOT / "checkpoints" / "qwen3_5_small"
    model = qwen_mtp.load(path, dtype="float32")
    ids = held_out_ids(load_tokenizer(path))
    starts = np.random.default_rng(0).integers(0, ids.size - args.prompt_len - 1, args.prompts)
    prompts = [ids[s:s + args.prompt_len] for s in starts]
    plain = _twice(model, prompts, args.new, None)
    print(f"shipped model (float32), {args.prompts} held-out prompts of {args.prompt_len} tokens as one batch, "
          f"{args.new} new tokens, greedy; plain decode {plain.stats.decode_tokens_per_s:.1f} tok/s", flush=True)
    print(f"{'rows':>4}  {'drafts':<32} {'AL':>5} {'tok/s':>7} {'x plain':>7}  H[n]; accepts / tries per sibling rank")
    for rows, label, spec in _specs([4, 8]):
        r = _twice(model, prompts, args.new, spec)
        assert np.array_equal(r.tokens, plain.tokens), f"{label}: differs from plain greedy"
        st = r.stats
        ranks = ""
        if st.tree is not None:
            ranks = "; " + " ".join(f"{a}/{t}" for a, t in zip(st.tree["rank_accepts"], st.tree["rank_tries"]))
        print(f"{rows:>4}  {label:<32} {st.acceptance_length:5.2f} {st.decode_tokens_per_s:7.1f} "
              f"{st.decode_tokens_per_s / plain.stats.decode_tokens_per_s:7.2f}  {st.accept_hist.tolist()}{ranks}",
              flush=True)


def round_cost(args):
    import jax

    import qwen_mtp
    from qwen_mtp.head.draft_vocab import build_draft_vocab
    from qwen_mtp.head.tree import DynamicTree, StaticTree
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = real_shapes.config("Qwen3.5-0.8B")
    model = qwen_mtp.Model(config=cfg, weights=random_weights(cfg, 0, "bfloat16"), path="<random 0.8B shape>",
                           dtype="bfloat16")
    jax.block_until_ready(model.weights)
    spec_model = build_draft_vocab(model, np.arange(cfg.vocab_size)[::-1], 32768)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 64))
    new = args.new_0p8b
    plain = _twice(model, ids, new, None)
    step = plain.stats.tpot_s
    print(f"Qwen3.5-0.8B shape, random bf16 weights, batch 1, prompt 64, {new} new tokens, draft vocabulary 32768: "
          f"plain TPOT {1e3 * step:.1f} ms", flush=True)
    for label, spec in (("chain k=3 (4 rows)", qwen_mtp.SpecConfig(k=3)),
                        ("static (2, 1, 1) (7 rows)", qwen_mtp.SpecConfig(k=3, tree=StaticTree((2, 1, 1)))),
                        ("static (2, 2, 1) (11 rows)", qwen_mtp.SpecConfig(k=3, tree=StaticTree((2, 2, 1)))),
                        ("dynamic depth 3 topk 2 budget 6 (7 rows)",
                         qwen_mtp.SpecConfig(k=3, tree=DynamicTree(3, 2, 6)))):
        r = _twice(spec_model, ids, new, spec)
        assert np.array_equal(r.tokens, plain.tokens), f"{label}: differs from plain greedy"
        st = r.stats
        round_s = st.decode_s / (st.rounds / st.batch)
        print(f"  {label:<42} round {1e3 * round_s:7.1f} ms = {round_s / step:.2f} plain steps", flush=True)


def gdn_forms(args):
    import jax
    import jax.numpy as jnp

    from qwen_mtp.decoding.tree_verify import per_path_core, tree_core
    from qwen_mtp.head.tree import StaticTree, static_layout, static_parents

    h, d = 16, 128
    for widths in ((2, 2, 1), (2, 1, 1, 1), (3, 2, 1)):
        tree = StaticTree(widths)
        par = static_parents(tree)
        N1 = len(par)
        leaves = [i for i in range(N1) if i not in set(par[1:].tolist())]
        paths = []
        for leaf in leaves:
            p = [leaf]
            while p[-1] != 0:
                p.append(int(par[p[-1]]))
            p = p[::-1]
            paths.append(p + [p[-1]] * (tree.depth + 1 - len(p)))
        r = np.random.default_rng(0)
        n = lambda *s, r=r: jnp.asarray(r.standard_normal(s), jnp.float32)
        l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        q, k, v = l2(n(1, N1, h, d)), l2(n(1, N1, h, d)), n(1, N1, h, d)
        g, beta = -jnp.abs(n(1, N1, h)) * 0.1, jax.nn.sigmoid(n(1, N1, h))
        state = n(1, h, d, d) * 0.1
        lay = static_layout(tree, 1)
        f_tree = jax.jit(lambda *a, lay=lay, D=tree.depth: tree_core(*a, lay.mask, lay.depth, D)[0])
        f_rows = jax.jit(lambda *a, mask=lay.mask: tree_core(*a, mask)[0])
        paths = np.asarray(paths)
        f_path = jax.jit(lambda *a, paths=paths: per_path_core(*a, paths))
        a = (q, k, v, g, beta, state)
        err = float(jnp.abs(f_tree(*a) - f_path(*a)).max())
        forms = {"tree": f_tree, "tree row by row": f_rows, "per-path": f_path}
        blocks = {name: [] for name in forms}
        for f in forms.values():
            jax.block_until_ready(f(*a))
        for _ in range(9):  # the forms' blocks interleaved: a shared machine's load hits them alike
            for name, f in forms.items():
                t = time.perf_counter()
                for _ in range(20):
                    out = f(*a)
                jax.block_until_ready(out)
                blocks[name].append((time.perf_counter() - t) / 20)
        times = {name: statistics.median(b) for name, b in blocks.items()}
        print(f"GDN core, tree {widths} ({N1} rows, {len(paths)} paths of {tree.depth + 1}): tree form (solve by "
              f"depth) {1e3 * times['tree']:.2f} ms, (solve row by row) {1e3 * times['tree row by row']:.2f} ms, "
              f"per-path {1e3 * times['per-path']:.2f} ms per layer (max abs difference {err:.1e})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="shipped,0p8b,gdn", help="comma separated: shipped, 0p8b, gdn")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64, help="new tokens on the shipped model")
    ap.add_argument("--new-0p8b", type=int, default=16, help="new tokens at the 0.8B shape")
    args = ap.parse_args(argv)
    parts = [p for p in args.part.split(",") if p]
    if not parts or any(p not in ("shipped", "0p8b", "gdn") for p in parts):
        ap.error(f"--part: expected some of shipped, 0p8b, gdn; found {args.part!r}")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    for p in parts:
        {"shipped": shipped, "0p8b": round_cost, "gdn": gdn_forms}[p](args)


if __name__ == "__main__":
    main()
