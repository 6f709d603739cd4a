"""Tree drafts (decoding/tree_*.py, head/tree.py): lossless against plain decoding, a width-1 tree is the chain,
the tree verify's GDN states are sequential steps along every root-to-node path, the head's tree entries in the
Wind-MTP ring (sinks + W + depth * width slots, constant in the context) are its steps along every path, the
memory sizing counts a tree's buffers, sampled trees keep the distribution, every tree program lowers for cuda
at real shapes. Few compiles: one model per property, the loop programs shared where the settings allow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

import qwen_mtp
from qwen_mtp.decoding import tree_loop
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.decoding.tree_verify import gdn_state_after, tree_gdn_layer
from qwen_mtp.errors import ArgumentError
from qwen_mtp.head import tree as tree_mod
from qwen_mtp.head.tree import DynamicTree, StaticTree
from qwen_mtp.trunk.gdn import gdn_layer
from qwen_mtp.trunk.state import GDNState, KVCache

PROMPTS = [np.random.RandomState(1).randint(0, 97, 9), np.random.RandomState(2).randint(0, 97, 40)]


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(a - b).max()
    return err < 1e-5 or err / max(np.abs(b).max(), 1e-30) < 1e-4, err


# ------------------------------------------------------------------------------ GDN along every root-to-node path
IRREGULAR = np.array([0, 0, 1, 1, 0, 2, 4, 5, 3, 8, 6], np.int32)  # depths 1..4, parents before children


def _paths(parent):
    out = []
    for i in range(len(parent)):
        p = [i]
        while p[-1] != 0:
            p.append(int(parent[p[-1]]))
        out.append(p[::-1])
    return out


def test_tree_gdn_states_equal_sequential_steps_along_every_path(ckpt, report):
    """Per node: the tree form's output and the state after the node (conv window and recurrent state) against
    gdn_layer's step form run token by token along the node's path from the root, from the same state (each node
    one step from its parent's stepped state: one step program). Row 0 a static tree (2, 2, 1), row 1 an
    irregular one. The control: every node taking its predecessor in node order as parent breaks the match."""
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    cfg = model.config
    w = model.weights.layers[0].mixer
    parents = np.stack([tree_mod.static_parents(StaticTree((2, 2, 1))), IRREGULAR])
    B, N1 = parents.shape
    r = np.random.RandomState(0)
    x = jnp.asarray(r.randn(B, N1, cfg.hidden_size), jnp.float32)
    st = GDNState(jnp.asarray(r.randn(B, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32),
                  jnp.asarray(0.3 * r.randn(B, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim),
                              jnp.float32))
    step = jax.jit(lambda x, st: gdn_layer(x, w, cfg, st, jnp.ones((B,), jnp.int32), mode="step"))
    refs = []  # (output, state after) of node i: its parent's state stepped by x_i (the root: st stepped by x_0)
    for i in range(N1):
        prev = st if i == 0 else GDNState(*(jnp.stack([refs[parents[b, i]][1][f][b] for b in range(B)])
                                            for f in (0, 1)))
        o, s = step(x[:, i:i + 1], prev)
        refs.append((o[:, 0], (s.conv, s.rec)))
    layer = jax.jit(lambda x, st, layout: tree_gdn_layer(x, w, cfg, st, layout))
    after = jax.jit(gdn_state_after)

    def check(par):
        layout = tree_mod.layout_from_parents(jnp.asarray(par), 4, 2)
        out, tv = layer(x, st, layout)
        worst, ok = 0.0, True
        for i in range(N1):
            got = after(tv, layout, jnp.full((B,), i, jnp.int32))
            for a, e in ((out[:, i], refs[i][0]), (got.conv, refs[i][1][0]), (got.rec, refs[i][1][1])):
                good, err = _close(a, e)
                ok, worst = ok and good, max(worst, err)
        return ok, worst

    ok, worst = check(parents)
    assert ok, worst
    predecessor = np.broadcast_to(np.maximum(np.arange(N1) - 1, 0), (B, N1)).astype(np.int32)
    bad_ok, bad_worst = check(predecessor)
    report(f"tree GDN vs steps along each path: max abs err {worst:.2e} over {B * N1} nodes; "
           f"predecessor-as-parent control: {bad_worst:.2e}")
    assert not bad_ok and bad_worst > 1e-2


# --------------------------------------------------------------------------------------- the Wind-MTP ring, memory
def test_wind_mtp_ring_holds_the_tree(ckpt, report):
    """A tree spec's ring is sinks + W + depth * width slots at every context length (kv_cache_bytes sizes it
    as generate allocates it; width: the most nodes the head runs at one depth). Drafting a static tree into
    it: every expanded node's head output equals the head stepped along the node's root-to-node path
    (mtp_forward, one row at a time, on the same ring), with junk in every slot no window of the round reaches.
    The control: a ring sized for the chain (sinks + W + k) lets the entries overwrite rows the windows and the
    ancestors need, and breaks the match."""
    from kernels_pallas.ring_layout import ring_rows, visible
    from qwen_mtp.decoding import memory
    from qwen_mtp.decoding.tree_draft import _draft_static
    from qwen_mtp.head.mtp import mtp_forward

    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    cfg, W, S = model.config, 4, 1
    tree = StaticTree((2, 2, 1))
    spec = SpecConfig(k=3, window=W, sinks=S, tree=tree)
    row = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    sizes = {n: memory.kv_cache_bytes(model, n, spec=spec)["mtp"] for n in (64, 4096, 1 << 20)}
    assert tree.width == 4 and spec.draft_slots == 12 and set(sizes.values()) == {(S + W + 3 * 4) * row}, sizes
    assert SpecConfig(k=3, window=W, sinks=S, tree=StaticTree((1, 1, 1))).draft_slots == SpecConfig(k=3).k
    assert SpecConfig(k=3, window=W, tree=DynamicTree(3, 2, 6)).draft_slots == 3 * 2

    B, pos = 2, jnp.asarray([30, 33], jnp.int32)
    r = np.random.RandomState(3)
    m1 = jnp.asarray(r.randn(B, cfg.hidden_size), jnp.float32)
    x = jnp.asarray([5, 7], jnp.int32)
    step = jax.jit(lambda t, h, c, at: mtp_forward(model.weights, cfg, t, h, c, at, window=W, sinks=S)[:2])
    draft = jax.jit(lambda c: _draft_static(model.weights, cfg, c, m1, x, pos, spec, tree, Sampling(),
                                            jax.random.PRNGKey(0), None))
    parent = tree_mod.static_parents(tree)

    def check(slots):
        shape = (B, slots, cfg.num_kv_heads, cfg.head_dim)
        held = ring_rows(pos - 1, S, slots - S)  # what each slot holds at the round's start
        reached = jnp.any(jnp.stack([visible(held, (pos - 1 + j)[:, None], W, S) for j in range(1, tree.depth)]), 0)
        ring = KVCache(*(jnp.where(reached[:, :, None, None], jnp.asarray(r.randn(*shape), jnp.float32), 1e3)
                         for _ in range(2)))
        tokens, _, _, _, M = draft(ring)
        ok, worst = True, 0.0
        for node in range(1, tree.expanded + 1):
            path = [node]
            while parent[path[0]] != 0:
                path.insert(0, int(parent[path[0]]))
            c, h = ring, m1[:, None]
            for d, n in enumerate(path, start=1):  # node n of depth d at head row pos - 1 + d
                h, c = step(tokens[:, n:n + 1], h, c, pos - 1 + d)
            good, e = _close(M[:, node], h[:, 0])
            ok, worst = ok and good, max(worst, e)
        return ok, worst

    ok, err = check(S + W + spec.draft_slots)
    bad_ok, bad = check(S + W + spec.k)
    report(f"tree entries in the Wind-MTP ring ({S} + {W} + 3 x 4 slots): head vs steps along each path, max err "
           f"{err:.2e} over {tree.expanded} nodes; ring sized for the chain (control): {bad:.2e}")
    assert ok and not bad_ok and bad > 1e-2, (err, bad)


def test_memory_counts_the_tree_buffers(ckpt, monkeypatch):
    """request_bytes (what generate refuses before allocating): a tree's verify rows in the GDN rollback terms,
    the tree rows' attention K / V, a native head's tree entries, the ring's depth * width draft slots; a device
    with room for the chain's request but not the tree's refuses the tree."""
    from qwen_mtp.decoding import memory
    from qwen_mtp.decoding.request import make_request, request_bytes
    from qwen_mtp.errors import InsufficientMemoryError

    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    cfg = model.config
    need = lambda spec: request_bytes(model, make_request(model, PROMPTS, 16, spec, 0.0, 0, 1.0, 0, [], 64, False, None,
                                                          1.3))
    chain, tree = need(SpecConfig(k=3)), need(SpecConfig(k=3, tree=StaticTree((2, 2, 1))))
    row = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    assert tree["tree verify K/V"] == attn * 2 * 11 * row and tree["tree head entries"] == 2 * 6 * row
    assert tree["verify GDN states"] > chain["verify GDN states"] and "tree verify K/V" not in chain
    assert tree["repetition penalty context"] == 2 * cfg.vocab_size * 12
    windowed = need(SpecConfig(k=3, window=8, tree=StaticTree((2, 2, 1))))
    assert windowed["head cache"] == 2 * (8 + 12) * row and "tree head entries" not in windowed
    monkeypatch.setattr(memory, "available_bytes", lambda d: ((chain["total"] + tree["total"]) // 2, "a test device"))
    memory.check(model, chain)
    with pytest.raises(InsufficientMemoryError):
        qwen_mtp.generate(model, PROMPTS, 16, spec=SpecConfig(k=3, tree=StaticTree((2, 2, 1))), eos_token_id=[],
                          repetition_penalty=1.3, prefill_chunk=64)


# ------------------------------------------------------------------------------------------- lossless, end to end
def test_greedy_trees_equal_plain_greedy_and_width_one_is_the_chain(ckpt, report):
    """dense_mtp, greedy: a width-1 tree with Wind-MTP gives the chain's tokens and statistics (H[n], the
    per-position hits), both equal to plain greedy, as do a static (2, 2, 1) tree in the ring (sinks + W + 3 x 4
    slots) and a dynamic tree with a native head (siblings of rank 1 accepted: their paths committed). The MoE
    trunk: the lowering test below; the repetition penalty: the sampled width-one test."""
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    run = lambda spec=None: qwen_mtp.generate(model, PROMPTS, 16, eos_token_id=[], spec=spec)
    plain = run()
    chain, one = run(SpecConfig(k=3, window=4, sinks=1)), run(SpecConfig(k=3, window=4, sinks=1,
                                                                         tree=StaticTree((1, 1, 1))))
    np.testing.assert_array_equal(chain.tokens, plain.tokens)
    np.testing.assert_array_equal(one.tokens, chain.tokens)
    np.testing.assert_array_equal(one.stats.accept_hist, chain.stats.accept_hist)
    np.testing.assert_array_equal(one.stats.position_hits, chain.stats.position_hits)
    for spec in (SpecConfig(k=3, window=4, sinks=1, tree=StaticTree((2, 2, 1))),
                 SpecConfig(k=3, tree=DynamicTree(depth=3, topk=2, budget=6))):
        res = run(spec)
        np.testing.assert_array_equal(res.tokens, plain.tokens)
        st = res.stats
        assert st.rounds == int(st.accept_hist.sum()) > 0 and st.tree is not None
        assert st.tree["rank_accepts"][1:].sum() > 0, st.tree
        report(f"greedy tree {spec.tree} window={spec.window}: == plain, H[n]={st.accept_hist.tolist()}, "
               f"rank accepts {st.tree['rank_accepts'].tolist()} of {st.tree['rank_tries'].tolist()}")


def test_sampled_width_one_tree_is_the_chain(ckpt):
    """Same tokens and the same statistics with the same keys (draws, rejections, residuals), under a repetition
    penalty (each node's logits and drafts penalised with the context through its path, as the chain's)."""
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    kw = {"eos_token_id": [], "temperature": 1.0, "seed": 5, "repetition_penalty": 1.3}
    chain = qwen_mtp.generate(model, PROMPTS, 16, spec=SpecConfig(k=3), **kw)
    tree = qwen_mtp.generate(model, PROMPTS, 16, spec=SpecConfig(k=3, tree=StaticTree((1, 1, 1))), **kw)
    np.testing.assert_array_equal(tree.tokens, chain.tokens)
    np.testing.assert_array_equal(tree.stats.accept_hist, chain.stats.accept_hist)
    np.testing.assert_array_equal(tree.stats.position_hits, chain.stats.position_hits)


# ------------------------------------------------------------------------------------------------------- sampling
NS = 2000  # independent rows
PROMPT = [5, 17, 42, 8]


def _pvalue(a, b, j):
    table = np.stack([np.bincount(a[:, j], minlength=97), np.bincount(b[:, j], minlength=97)])
    return chi2_contingency(table[:, table.sum(0) > 0])[1]


def test_sampled_tree_keeps_the_distribution(ckpt, report):
    """End to end: chi-square per position of plain sampling against a static tree of 3 independent siblings
    then a chain (SpecInfer's recursive rejection), 2000 rows each, with later siblings accepted many times."""
    model = qwen_mtp.load(ckpt("dense_mtp")[1])
    kw = {"eos_token_id": [], "temperature": 1.0}
    plain = qwen_mtp.generate(model, [PROMPT] * NS, 3, seed=1, **kw).tokens
    res = qwen_mtp.generate(model, [PROMPT] * NS, 3, seed=2, spec=SpecConfig(k=2, tree=StaticTree((3, 1))), **kw)
    t = res.stats.tree
    assert t["rank_accepts"][1:].sum() > 100, t  # later siblings were accepted: the residual was used
    pvals = [_pvalue(plain, res.tokens, j) for j in range(1, 3)]
    report(f"sampled tree (3, 1) vs plain, 2000 rows: p-values {[f'{p:.3f}' for p in pvals]}, rank accepts "
           f"{t['rank_accepts'].tolist()} of {t['rank_tries'].tolist()}")
    assert min(pvals) > 1e-3, pvals


P1 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])  # the target at the root
P2 = np.array([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1], [0.05, 0.05, 0.8, 0.05, 0.05],
               [0.2, 0.2, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.05, 0.05]])  # the target after token a: P2[a]
Q1 = np.array([0.1, 0.1, 0.2, 0.3, 0.3])  # the draft at the root
Q2 = P2[::-1] * 0.5 + 0.1  # the draft after token a (rows sum to 1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["iid-siblings", "top-choices"])
def test_tree_acceptance_is_exact(deterministic, report):
    """accept_tree on a known target: a (3, 1) tree per row, siblings drawn independently from the draft (a
    static tree) or the draft's top choices (a dynamic tree). The first two tokens of the output (the second
    drawn from P2[x1] where the round emitted one) must follow P1[x1] P2[x1, x2] exactly: a goodness-of-fit
    chi-square over 40000 rows. The control tries every sibling against p instead of the residual."""
    from scipy.stats import chisquare

    from qwen_mtp.decoding.tree_accept import accept_tree
    from qwen_mtp.head.tree import static_layout

    n, V = 40_000, 5
    tree = StaticTree((3, 1))
    layout = static_layout(tree, n)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    if deterministic:
        t1 = jnp.broadcast_to(jnp.argsort(-Q1)[:3], (n, 3))
        t2 = jnp.argmax(jnp.asarray(Q2)[t1], axis=-1)
        Q = None
    else:
        t1 = jax.random.categorical(k1, jnp.log(jnp.asarray(Q1)), shape=(n, 3))
        t2 = jax.random.categorical(k2, jnp.log(jnp.asarray(Q2))[t1])
        Q = jnp.concatenate([jnp.broadcast_to(jnp.asarray(Q1), (n, 1, V)), jnp.asarray(Q2)[t1],
                             jnp.zeros((n, 3, V))], axis=1).astype(jnp.float32)
    tokens = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), t1, t2], axis=1).astype(jnp.int32)
    logits = jnp.log(jnp.concatenate([jnp.broadcast_to(jnp.asarray(P1), (n, 1, V)), jnp.asarray(P2)[t1],
                                      jnp.full((n, 3, V), 1.0 / V)], axis=1)).astype(jnp.float32)
    expected = (P1[:, None] * P2).reshape(-1) * n

    accept = jax.jit(accept_tree, static_argnums=(4, 6))  # the control's flag traced: one program for both

    def pvalue(broken):
        acc = accept(tokens, layout, Q, logits, Sampling(temperature=1.0), k3, deterministic, jnp.asarray(broken))
        x1 = jnp.where(acc.n >= 1, tokens[jnp.arange(n), acc.path[:, 1]], acc.bonus)
        x2 = jnp.where(acc.n >= 2, tokens[jnp.arange(n), acc.path[:, 2]], jnp.where(acc.n == 1, acc.bonus, -1))
        x2 = jnp.where(x2 < 0, jax.random.categorical(k4, jnp.log(jnp.asarray(P2))[x1]), x2)
        seen = np.bincount(np.asarray(x1 * V + x2), minlength=V * V)
        return chisquare(seen, expected)[1], np.asarray(acc.rank_acc).sum(0)

    p, ranks = pvalue(False)
    p_bad, _ = pvalue(True)
    report(f"tree acceptance ({'top choices' if deterministic else 'iid siblings'}): goodness of fit p {p:.3f}, "
           f"accepts per sibling rank {ranks.tolist()}; broken residual p {p_bad:.1e}")
    assert ranks[1:].sum() > 1000
    assert p > 1e-3 and p_bad < 1e-6, (p, p_bad)


# ------------------------------------------------------------------------------------------------ arguments, cuda
@pytest.mark.parametrize("make", [lambda: SpecConfig(k=3, tree=StaticTree((2, 2))),
                                  lambda: SpecConfig(k=2, tree=(2, 1)),
                                  lambda: StaticTree((0, 1)), lambda: StaticTree([2, 1]),
                                  lambda: DynamicTree(depth=2, topk=2, budget=7)])
def test_bad_tree_arguments(make):
    with pytest.raises(ArgumentError):
        make()


def tree_args(cfg, dtype, spec, B=2, cache=1024, cap=32, n_eos=1):
    """tree_loop.tree_decode's arrays as ShapeDtypeStructs (nothing allocated), its static cfg, spec and sampling
    aside: (weights, state, head cache, carry, eos, max_new, until). tests/gpu_compile_kernels.py --trees too."""
    from qwen_mtp.head.mtp import init_mtp_cache
    from qwen_mtp.trunk.state import init_state
    from qwen_mtp.trunk.weights import weight_shapes

    i32, SDS = jnp.int32, jax.ShapeDtypeStruct
    state = jax.eval_shape(lambda: init_state(cfg, B, cache, dtype))
    head = jax.eval_shape(lambda: init_mtp_cache(cfg, B, cache, dtype, window=spec.window, sinks=spec.sinks,
                                                 k=spec.draft_slots))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    eos, scalar = SDS((n_eos,), i32), SDS((), i32)
    carry = jax.eval_shape(lambda *a: tree_loop.tree_start(*a, cap=cap, spec=spec), SDS((B,), i32),
                           SDS((B, cfg.hidden_size), dtype), SDS((B,), i32), SDS(key.shape, key.dtype), eos, scalar,
                           scalar)
    return weight_shapes(cfg, dtype), state, head, carry, eos, scalar, scalar


def _tree_program(cfg, dtype, spec, sampling, B=2, cache=1024, cap=32):
    """tree_loop.tree_decode exported for cuda at abstract shapes (nothing allocated)."""
    from qwen_mtp.tools.lowering import export_for

    w, *rest = tree_args(cfg, dtype, spec, B, cache, cap)
    return export_for(tree_loop.tree_decode, w, cfg, *rest, platform="cuda", spec=spec, sampling=sampling)


@pytest.mark.parametrize("spec,sampling", [
    (SpecConfig(k=4, window=4032, sinks=64, tree=StaticTree((2, 2, 1, 1))), Sampling(temperature=0.7, top_k=50)),
    (SpecConfig(k=3, tree=DynamicTree(depth=3, topk=2, budget=8)), Sampling()),
], ids=["static-windowed-sampled", "dynamic-native-greedy"])
def test_tree_loop_lowers_for_cuda_at_real_shapes(spec, sampling):
    """Qwen3.5-27B (dense) for the static tree, Qwen3.5-35B-A3B (MoE) for the dynamic one, 4 layers each."""
    from qwen_mtp.tools import real_shapes

    name = "Qwen3.5-27B" if isinstance(spec.tree, StaticTree) else "Qwen3.5-35B-A3B"
    exported = _tree_program(real_shapes.config(name, layers=4), jnp.bfloat16, spec, sampling)
    assert exported.platforms == ("cuda",) and "stablehlo.while" in exported.mlir_module()
