"""`python -m qwen_mtp generate PROMPT`: load, pick k (--k auto) and the draft vocabulary, precompile, stream the
continuation and print one stats line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from qwen_mtp.decoding.auto_k import pick_k
from qwen_mtp.decoding.stats import compile_counts, fmt, format_alphas, warmup_note
from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading.folder import (
    default_model_path,
    generation_repetition_penalty,
    load_tokenizer,
)
from qwen_mtp.parallel.distributed import same_on_every_process, start_distributed
from qwen_mtp.tools.cli.text_stream import TextStream


class _Discard:
    """A text stream that drops what is written (the output of processes other than process 0)."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


DRAFT_VOCAB_AUTO = 1024  # the size that won end to end on the shipped model (README "Speed")


def _with_draft_vocab(model, path, choice, log):
    """--draft-vocab: 'off' drafts over the whole vocabulary; N over the N most frequent ids of the folder's
    token counts (draft_vocab_counts.npy); 'auto' takes DRAFT_VOCAB_AUTO when the folder has counts and its
    vocabulary is larger, else the whole vocabulary. Output is the same either way; only speed changes."""
    from qwen_mtp import with_draft_vocab
    from qwen_mtp.head.draft_vocab import COUNTS_FILE

    if choice == "off":
        return model
    if choice == "auto":
        if not (Path(path) / COUNTS_FILE).is_file() or model.config.vocab_size <= DRAFT_VOCAB_AUTO:
            return model
        choice = DRAFT_VOCAB_AUTO
    return with_draft_vocab(model, choice)


TREE_FORMS = "widths per depth like 2,2,1 (integers in [1, 8]) or dynamic:DEPTH,TOPK,BUDGET"


def tree_arg(value: str):
    """--tree: '2,2,1' a static tree (StaticTree(widths), its depth is k); 'dynamic:D,K,N' EAGLE-2's dynamic
    tree (DynamicTree(depth=D, topk=K, budget=N))."""
    from qwen_mtp.head.tree import DynamicTree, StaticTree

    dynamic = value.startswith("dynamic:")
    parts = value.removeprefix("dynamic:").split(",")
    try:
        nums = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {TREE_FORMS}, found {value!r}") from None
    if dynamic and len(nums) != 3:
        raise argparse.ArgumentTypeError(f"expected {TREE_FORMS}, found {value!r}")
    try:
        return DynamicTree(*nums) if dynamic else StaticTree(nums)
    except ArgumentError as e:  # the shape's own limits (widths, node count, budget)
        raise argparse.ArgumentTypeError(f"expected {e.expected} ({e.argument}), found {value!r}") from None


def tree_shape(tree) -> str:
    """A tree as --tree spells it."""
    from qwen_mtp.head.tree import DynamicTree

    if isinstance(tree, DynamicTree):
        return f"dynamic:{tree.depth},{tree.topk},{tree.budget}"
    return ",".join(map(str, tree.widths))


def _tree_depth(args):
    """k for --tree (its depth); --k, when given, must equal it."""
    if args.no_spec:
        raise ArgumentError("--tree", "no --no-spec (a tree drafts speculatively)", tree_shape(args.tree))
    if args.k is not None and args.k != args.tree.depth:
        raise ArgumentError("--k", f"no --k with --tree, or the tree's depth {args.tree.depth}", args.k)
    return args.tree.depth


def k_was_not_timed(args) -> bool:
    """--k auto already compiled and ran every candidate, the chosen one included."""
    return args.no_spec or args.k != "auto" or getattr(args, "tree", None) is not None


def cmd_generate(args) -> int:
    if args.distributed:
        start_distributed()
    import jax

    from qwen_mtp import load
    from qwen_mtp.decoding.generate import generate, precompile
    from qwen_mtp.decoding.speculative import SpecConfig
    from qwen_mtp.parallel.sharding import parse_mesh

    lead = jax.process_index() == 0  # with several processes, only process 0 prints
    stdout, stderr = (sys.stdout, sys.stderr) if lead else (_Discard(), _Discard())
    mesh_text = args.mesh
    if mesh_text is None and jax.process_count() > 1:
        mesh_text = "model=-1"  # one job over every device of every process: tensor parallel
    mesh = None if mesh_text is None else parse_mesh(mesh_text)  # a bad --mesh fails before anything loads
    path = Path(args.model) if args.model else default_model_path()
    tree = getattr(args, "tree", None)
    tree_k = None if tree is None else _tree_depth(args)  # refused before the weights load
    penalty, penalty_from = args.repetition_penalty, "--repetition-penalty"
    if penalty is None:  # read (and a bad file refused) before the weights load
        penalty, penalty_from = generation_repetition_penalty(path), "generation_config.json"
    penalty = 1.0 if penalty is None else penalty
    model = load(path, quant=args.quant, group_size=args.group_size, mesh=mesh)  # each process reads its slices
    if mesh is not None:
        print("\n".join(("[mesh] " if i == 0 else "       ") + line
                        for i, line in enumerate(model.describe_sharding().splitlines())), file=stderr, flush=True)
    tok = load_tokenizer(path)
    ids = np.asarray(tok.encode(args.prompt).ids, np.int32)
    if ids.size == 0:
        raise ArgumentError("prompt", "text that encodes to at least one token", repr(args.prompt))
    sampling_kw = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                   "kv_dtype": args.kv_dtype, "repetition_penalty": penalty}
    make_spec = lambda k: SpecConfig(k=k, window=args.window, sinks=args.sinks, tree=tree)
    plan = None
    if tree is not None:  # a tree's depth is its k: no plan, no --k auto
        spec = make_spec(tree_k)
        if not model.has_mtp:
            raise ArgumentError("--model", "a checkpoint with an MTP head (mtp.* tensors), or no --tree",
                                f"{path} without mtp.*")
    elif args.no_spec:
        spec = None
    else:
        if not model.has_mtp:
            raise ArgumentError("--model", "a checkpoint with an MTP head (mtp.* tensors), or --no-spec",
                                f"{path} without mtp.*")
        k = args.k
        if k is None:  # no --k: the plan measured on this machine (serving/plan.py, cached); an explicit --k wins
            from qwen_mtp.serving.plan import generate_plan
            plan = generate_plan(_with_draft_vocab(model, path, args.draft_vocab, stderr), ids, args.max_new_tokens,
                                 sampling_kw, make_spec, log=stderr)
            k = same_on_every_process(plan.k_for(1)) or None
        elif k == "auto":
            k = pick_k(model, ids, args.max_new_tokens, sampling_kw, make_spec, log=stderr)
            k = same_on_every_process(k or 0) or None
        spec = None if k is None else make_spec(k)
    if spec is not None:
        model = _with_draft_vocab(model, path, args.draft_vocab, stderr)
    warm, counts = 0.0, None
    if not args.no_warmup and k_was_not_timed(args):
        # compile ahead of time every program the real run needs, running nothing (read back from the persistent
        # compilation cache when an earlier process compiled them: counts says how many)
        with compile_counts() as counts:
            warm = precompile(model, ids, args.max_new_tokens, spec=spec, **sampling_kw)
    stdout.write(args.prompt)
    out = TextStream(tok, stdout)
    t0 = time.perf_counter()
    r = generate(model, ids, args.max_new_tokens, spec=spec, stream=out, **sampling_kw)
    wall = time.perf_counter() - t0
    out.finish()
    s = r.stats
    line = (f"[{path.name}] {s.new_tokens} new tokens in {wall:.2f}s: {fmt(s.new_tokens / wall, '.1f')} tok/s end "
            f"to end, decode {fmt(s.decode_tokens_per_s, '.1f')} tok/s, TPOT {fmt(1e3 * s.tpot_s)} ms")
    if warm:
        line += f" ({warmup_note(warm, counts)})"
    if mesh is not None:
        line += (f", mesh data={mesh.shape['data']} model={mesh.shape['model']}"
                 + (f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    if spec is None:
        line += ", plain decoding"
    else:
        win = "native" if spec.window is None else f"window {spec.window} sinks {spec.sinks}"
        dv = model.weights.draft_vocab
        if dv is not None:
            win += f", draft vocab {dv.ids.shape[0]}"
        elif args.draft_vocab == "auto" and model.config.vocab_size > DRAFT_VOCAB_AUTO:
            from qwen_mtp.head.draft_vocab import COUNTS_FILE

            win += f", draft vocab off (no {COUNTS_FILE} in the folder)"  # a folder that lost its counts says so
        line += f", k={spec.k} ({win}), AL {fmt(s.acceptance_length)}, alpha_j [{format_alphas(s.alpha)}]"
        if s.tree is not None:
            line += (f", tree {tree_shape(spec.tree)}: acceptance per depth [{format_alphas(s.tree['depth_rate'])}] "
                     f"per sibling rank [{format_alphas(s.tree['rank_rate'])}]")
    if plan is not None:
        line += f", {plan.note()}"
    if penalty != 1.0:
        line += f", repetition penalty {penalty:g} ({penalty_from})"
    print(line, file=stderr if args.stats_to_stderr else stdout, flush=True)
    return 0
