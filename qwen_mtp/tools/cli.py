"""Command line: `python -m qwen_mtp generate "def fibonacci(n):"` (text in, streamed text out, one stats line).

With no --model it uses the small trained model shipped in checkpoints/qwen3_5_small.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from qwen_mtp.compiling import compile_cache, program_cache
from qwen_mtp.decoding.auto_k import K_AUTO_CANDIDATES, pick_k
from qwen_mtp.decoding.stats import fmt, format_alphas
from qwen_mtp.errors import ArgumentError, ConfigError, QwenMTPError
from qwen_mtp.loading.folder import default_model_path, generation_repetition_penalty, load_tokenizer
from qwen_mtp.parallel.distributed import same_on_every_process, start_distributed
from qwen_mtp.trunk.state import KV_DTYPE_NAMES


class TextStream:
    """Decodes ids as they arrive and writes only the new, complete text (a byte-level BPE token can end in the
    middle of a UTF-8 character: such a tail is held back until the next token completes it)."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0

    def __call__(self, rows):
        self.ids.extend(int(i) for i in rows[0])
        text = self.tok.decode(self.ids)
        end = len(text)
        while end > self.shown and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.shown:
            self.out.write(text[self.shown:end])
            self.out.flush()
            self.shown = end

    def finish(self):
        text = self.tok.decode(self.ids)
        if len(text) > self.shown:
            self.out.write(text[self.shown:])
        self.out.write("\n")
        self.out.flush()


def _k_arg(value: str):
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', found {value!r}") from None
    if not 1 <= k <= 16:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', found {k}")
    return k


def _nonneg_int(value: str):
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {value!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {v}")
    return v


def _pos_int(value: str):
    v = _nonneg_int(value)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {v}")
    return v


class _Discard:
    """A text stream that drops what is written (the output of processes other than process 0)."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


DRAFT_VOCAB_AUTO = 1024  # the size that won end to end on the shipped model (README "Speed")


def _draft_vocab_arg(value: str):
    if value in ("auto", "off"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, 'auto' or 'off', found {value!r}") from None


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


def k_was_not_timed(args) -> bool:
    """--k auto already compiled and ran every candidate, the chosen one included."""
    return args.no_spec or args.k != "auto"


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
    sampling_kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       kv_dtype=args.kv_dtype, repetition_penalty=penalty)
    make_spec = lambda k: SpecConfig(k=k, window=args.window, sinks=args.sinks)
    if args.no_spec:
        spec = None
    else:
        if not model.has_mtp:
            raise ArgumentError("--model", "a checkpoint with an MTP head (mtp.* tensors), or --no-spec",
                                f"{path} without mtp.*")
        k = args.k
        if k == "auto":
            k = pick_k(model, ids, args.max_new_tokens, sampling_kw, make_spec, log=stderr)
            k = same_on_every_process(k or 0) or None
        spec = None if k is None else make_spec(k)
    if spec is not None:
        model = _with_draft_vocab(model, path, args.draft_vocab, stderr)
    warm = 0.0
    if not args.no_warmup and k_was_not_timed(args):
        # compile ahead of time every program the real run needs, running nothing (read back from the persistent
        # compilation cache when an earlier process compiled them)
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
        line += f" (compile {warm:.1f}s not counted)"
    if mesh is not None:
        line += (f", mesh data={mesh.shape['data']} model={mesh.shape['model']}"
                 + (f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    if spec is None:
        line += ", plain decoding"
    else:
        win = "native" if spec.window is None else f"window {spec.window} sinks {spec.sinks}"
        dv = model.weights.draft_vocab
        win += "" if dv is None else f", draft vocab {dv.ids.shape[0]}"
        line += f", k={spec.k} ({win}), AL {fmt(s.acceptance_length)}, alpha_j [{format_alphas(s.alpha)}]"
    if penalty != 1.0:
        line += f", repetition penalty {penalty:g} ({penalty_from})"
    print(line, file=stderr if args.stats_to_stderr else stdout, flush=True)
    return 0


def penalty_arg(value: str) -> float:
    """argparse type of --repetition-penalty (the benchmarks take the same one)."""
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (1 = off), found {value!r}") from None
    if not 0 < r < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0 (1 = off), found {value!r}")
    return r


def _windows_arg(value: str):
    out = []
    for part in value.split(","):
        part = part.strip()
        if part == "native":
            out.append(None)
            continue
        try:
            w = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1 or 'native', found {part!r}") \
                from None
        if w < 1:
            raise argparse.ArgumentTypeError(f"expected windows >= 1, found {w}")
        out.append(w)
    return out


def cmd_analyze_window(args) -> int:
    from qwen_mtp import load
    from qwen_mtp.tools.analysis import (
        ab_probe,
        attention_mass,
        dose_response,
        format_alpha_intervals,
        format_dose_response,
        plot_results,
    )

    path = Path(args.model) if args.model else default_model_path()
    model = load(path)
    if not model.has_mtp:
        raise ArgumentError("--model", "a checkpoint with an MTP head (mtp.* tensors)", f"{path} without mtp.*")
    tok = load_tokenizer(path)
    if args.prompt_file:
        text = Path(args.prompt_file).read_text(encoding="utf-8")
    else:
        from checkpoints.corpus import held_out_text

        text = held_out_text()
    ids = np.asarray(tok.encode(text).ids, np.int32)
    need = args.prompts * args.prompt_len
    if ids.size < need:
        raise ArgumentError("--prompt-file", f"text of at least {need} tokens", f"{ids.size} tokens")
    step = ids.size // args.prompts
    prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    print(f"{path.name}: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_new_tokens} new tokens, "
          f"k={args.k}, sinks={args.sinks}; every run checked equal to plain greedy")
    results, plain = dose_response(model, prompts, args.max_new_tokens, args.k, args.windows, args.sinks)
    print("\ndose-response\n" + format_dose_response(results))
    print("\nper-position alpha_j\n" + format_alpha_intervals(results))
    seq = np.concatenate([prompts[0], plain.tokens[0]])
    print(f"\nA/B probe and attention mass (teacher-forced over prompt 0 + its output, {seq.size} tokens, rows where "
          "the window hides something)")
    print("| window | rows | same top-1 | flips | margin at flips | margin overall | native mass in window |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for w in args.windows:
        if w is None or w + args.sinks >= seq.size - 1:
            continue
        ab = ab_probe(model, seq, w, args.sinks)
        mass = attention_mass(model, seq, w, args.sinks)
        print(f"| {w} | {ab['rows']} | {fmt(ab['same_top1'], '.3f')} | {ab['flips']} | "
              f"{fmt(ab['margin_at_flips'], '.3f')} | {fmt(ab['margin_overall'], '.3f')} | {fmt(mass, '.3f')} |")
    if args.plot:
        plot_results(results, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


def cmd_convert(args) -> int:
    from tqdm import tqdm

    from qwen_mtp.loading import orbax_io

    def bar(total):  # over the tensors quantized / cast, once the source has loaded
        return tqdm(total=total, desc="quantize" if args.quant else "convert", unit="tensor", file=sys.stderr,
                    disable=args.no_progress)

    t = time.perf_counter()
    before, model = orbax_io.convert(args.src, args.dst, dtype=args.dtype, quant=args.quant,
                                     group_size=args.group_size, quant_lm_head=args.quant_lm_head,
                                     quant_mtp=not args.keep_mtp_bf16, overwrite=args.overwrite, progress=bar)
    after = model.weight_bytes()
    print(model.describe_quant())
    print(f"weights: {before / 2**20:.2f} MiB in {args.dtype} -> {after['total'] / 2**20:.2f} MiB "
          f"({after['quantized'] / 2**20:.2f} quantized + {after['plain'] / 2**20:.2f} plain), "
          f"{after['total'] / before:.3f} of {args.dtype}")
    print(f"wrote {args.dst} in {time.perf_counter() - t:.1f}s; run it with: python -m qwen_mtp generate "
          f"--model {args.dst} PROMPT")
    return 0


XPROF_PORT = 8791  # xprof's default web port


def cmd_profile(args) -> int:
    """Trace `--repeats` generate calls (prefill, then plain steps or speculative rounds) into --logdir, each in a
    step marker, and print the time of each phase and stage read back from the trace (profiling.py)."""
    from qwen_mtp import load
    from qwen_mtp.decoding.speculative import SpecConfig
    from qwen_mtp.tools.profiling import format_phase_table, format_top_ops, profile_generate, top_ops, trace_files

    path = Path(args.model) if args.model else default_model_path()
    model = load(path)
    tok = load_tokenizer(path)
    ids = np.asarray(tok.encode(args.prompt).ids, np.int32)
    if ids.size == 0:
        raise ArgumentError("prompt", "text of at least one token", repr(args.prompt))
    spec = None if args.no_spec else SpecConfig(k=args.k, window=args.window, sinks=args.sinks)
    if spec is not None and not model.has_mtp:
        raise ArgumentError("--model", "a checkpoint with an MTP head, or --no-spec", f"{path} without mtp.*")
    logdir = Path(args.logdir)
    t = time.perf_counter()
    r, texts, rows, calls = profile_generate(model, ids, args.max_new_tokens, logdir, repeats=args.repeats,
                                             spec=spec, kv_dtype=args.kv_dtype)
    print(r.stats.summary())
    loop = next(iter(calls))
    what = "round" if spec is not None else "plain decode step"
    print(f"\n{len(texts)} programs compiled, {args.repeats} calls traced in {time.perf_counter() - t:.1f}s; self "
          f"time per phase and stage over the traced calls ({loop}: ms per {what})")
    print(format_phase_table(rows, calls))
    print("\ntop ops\n" + format_top_ops(top_ops(logdir, args.top, texts)))
    run = trace_files(logdir)["run"]
    print(f"\ntrace: {run}\nopen it: pip install xprof && xprof --logdir {logdir} --port {XPROF_PORT}, then "
          f"http://localhost:{XPROF_PORT}/ (Trace Viewer; on a GPU also Overview, HLO Op Profile, Roofline). xprof "
          "listens on every network interface: use it on a trusted machine or through an SSH tunnel.")
    return 0


def cmd_certify(args) -> int:
    from qwen_mtp.tools.certify import Report, certify, write_report

    report = Report(dtype=args.dtype)
    save = (lambda r: write_report(r, args.report)) if args.report else None  # after every case
    try:
        certify(args.model, configs=args.configs, archs=args.archs, seed=args.seed, dtype=args.dtype,
                max_prompt=args.max_prompt, cases_per_arch=args.cases_per_arch, log=lambda line: print(line, flush=True), report=report, on_case=save)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {report.summary()}", flush=True)
        return 130
    if args.report:
        write_report(report, args.report)
        print(f"report written to {args.report}")
    if report.failed:
        print(f"FAILED: {len(report.failing)} divergence(s) that are not near-ties, "
              f"{len(report.loader_mismatches)} loader mismatch(es)", file=sys.stderr)
        return 1
    return 0


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m qwen_mtp", description="qwen-mtp: Qwen3.5 inference in JAX "
                                 "with the MTP head as speculative drafter")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a text prompt, streaming the decoded text")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--model", default=None, help="checkpoint folder (default: the shipped checkpoints/qwen3_5_small)")
    g.add_argument("--max-new-tokens", type=_pos_int, default=128)
    g.add_argument("--k", type=_k_arg, default=3, help="drafts per round, 1..16, or 'auto' to time plain and "
                   f"k in {list(K_AUTO_CANDIDATES)} on this machine and use the fastest (default 3)")
    g.add_argument("--window", type=_pos_int, default=None, help="Wind-MTP: the draft head attends to the last "
                   "WINDOW positions plus the sinks (default: native full attention)")
    g.add_argument("--sinks", type=_nonneg_int, default=0, help="with --window: the first SINKS positions stay "
                   "visible to the draft head (default 0)")
    g.add_argument("--no-spec", action="store_true", help="plain decoding, no MTP drafts")
    g.add_argument("--draft-vocab", type=_draft_vocab_arg, default="auto", metavar="N|auto|off", help="the draft "
                   "head scores only the N most frequent token ids (the model folder's draft_vocab_counts.npy); "
                   f"output unchanged. auto (default): {DRAFT_VOCAB_AUTO} when the folder has counts, else off")
    g.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None, help="quantize the weights as they "
                   "load (a Hugging Face checkpoint; python -m qwen_mtp convert saves the result)")
    g.add_argument("--group-size", type=_pos_int, default=128, help="with --quant int4: rows of K per scale")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None, help="dtype of the KV caches (trunk "
                   "and draft head); float8_e4m3fn halves their bytes (default: the compute dtype)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=_nonneg_int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--repetition-penalty", type=penalty_arg, default=None, metavar="R", help="divide the logit of every "
                   "id already in the text by R when positive, multiply when negative (Hugging Face's rule; 1 = "
                   "off; speculative output stays exactly the plain output). Default: the model folder's "
                   "generation_config.json repetition_penalty, else 1")
    g.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard the model over a device mesh: "
                   "tensor parallel over M devices, batch rows over D (the first D x M devices; an axis left out "
                   "has size 1, model=-1 takes the devices left). Default: one device, or model=-1 with several "
                   "processes")
    g.add_argument("--distributed", action="store_true", help="multi-process job (one process per host): "
                   "jax.distributed.initialize() first, the cluster found from SLURM / Open MPI / Cloud TPU or "
                   "from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; run the same command on every "
                   "process, process 0 prints")
    g.add_argument("--stats-to-stderr", action="store_true", help="print the stats line on stderr")
    g.add_argument("--no-warmup", action="store_true", help="time the first call too (it includes compiling); "
                   "by default every program is compiled ahead of time, running nothing, so tok/s is the "
                   "steady-state speed")
    g.add_argument("--compile-cache", default=None, metavar="DIR|off", help="jax's persistent compilation cache "
                   f"folder, so a second run compiles nothing (default: ${compile_cache.ENV}, else "
                   "~/.cache/qwen_mtp/jax; 'off' disables it)")
    g.set_defaults(func=cmd_generate)

    a = sub.add_parser("analyze-window", help="Wind-MTP: dose-response over draft windows, alpha_j with Wilson "
                       "intervals, A/B probe, attention mass")
    a.add_argument("--model", default=None)
    a.add_argument("--windows", type=_windows_arg, default=_windows_arg("16,64,256,1024,native"),
                   help="comma list of windows, 'native' for full attention (default 16,64,256,1024,native)")
    a.add_argument("--sinks", type=_nonneg_int, default=4)
    a.add_argument("--k", type=_pos_int, default=4)
    a.add_argument("--prompts", type=_pos_int, default=4)
    a.add_argument("--prompt-len", type=_pos_int, default=512)
    a.add_argument("--max-new-tokens", type=_pos_int, default=64)
    a.add_argument("--prompt-file", default=None, help="text to cut prompts from (default: the held-out stdlib "
                   "files the shipped model never saw)")
    a.add_argument("--plot", default=None, help="save a PNG of AL/TPOT and alpha_j per window here")
    a.add_argument("--compile-cache", default=None, metavar="DIR|off", help="as for generate")
    a.set_defaults(func=cmd_analyze_window)

    c = sub.add_parser("convert", help="quantize a checkpoint (Hugging Face, or one convert wrote) into an orbax "
                       "checkpoint folder that generate --model and qwen_mtp.load read directly")
    c.add_argument("src", help="source checkpoint folder")
    c.add_argument("dst", help="folder to write (must not exist, be empty, or --overwrite a converted one)")
    c.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None,
                   help="weight format (default: none, the tensors are only cast to --dtype)")
    c.add_argument("--group-size", type=int, default=128, help="int4: rows of K per scale, a power of two "
                   "(default 128)")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the tensors kept unquantized (default bfloat16)")
    c.add_argument("--quant-lm-head", action="store_true", help="quantize the lm_head too (a tied one as a "
                   "quantized copy of embed^T)")
    c.add_argument("--keep-mtp-bf16", action="store_true", help="keep the MTP head unquantized, in --dtype")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it is a folder convert wrote")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    f = sub.add_parser("profile", help="trace generate calls with jax.profiler and print the time of each phase "
                       "(prefill, draft, verify, accept, commit, rollback, refill) and stage from the trace")
    f.add_argument("prompt", nargs="?", default="import os\nimport sys\n\n\ndef main(argv):\n",
                   help="the text to continue (default: a few lines of Python)")
    f.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    f.add_argument("--max-new-tokens", type=_pos_int, default=64)
    f.add_argument("--k", type=_pos_int, default=3, help="drafts per round (default 3)")
    f.add_argument("--window", type=_pos_int, default=None, help="Wind-MTP window (default: native)")
    f.add_argument("--sinks", type=_nonneg_int, default=0)
    f.add_argument("--no-spec", action="store_true", help="profile plain decoding instead")
    f.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None)
    f.add_argument("--repeats", type=_pos_int, default=2, help="traced generate calls, a step marker each")
    f.add_argument("--top", type=_pos_int, default=15, help="rows of the top-ops table")
    f.add_argument("--logdir", default="traces", help="where the trace goes (default ./traces): give the same "
                   "folder to xprof --logdir")
    f.set_defaults(func=cmd_profile)

    r = sub.add_parser("certify", help="the lossless certificate: plain vs speculative greedy over random "
                       "configurations (and random tiny architectures); exit 1 on a divergence that is not a "
                       "bf16 near-tie")
    r.add_argument("--model", default=None, help="checkpoint folder with an MTP head (default: the shipped model)")
    r.add_argument("--configs", type=int, default=50, help="random configurations on the model (default 50)")
    r.add_argument("--archs", type=int, default=0, help="random tiny architectures (default 0)")
    r.add_argument("--cases-per-arch", type=int, default=2, help="configurations run on each random architecture "
                   "(default 2)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    r.add_argument("--max-prompt", type=int, default=512, help="longest prompt row drawn (default 512)")
    r.add_argument("--report", default=None, metavar="FILE", help="write the report as JSON")
    r.add_argument("--compile-cache", default=None, metavar="DIR|off", help="as for generate")
    r.set_defaults(func=cmd_certify)
    return ap


def preflight(args) -> None:
    """What a command will need at its end, checked before any work: the optional packages of the features asked
    for (extras.py) and the folders outputs are written into."""
    from qwen_mtp.extras import require

    if getattr(args, "plot", None):
        require("--plot", "plot")
        parent = Path(args.plot).resolve().parent
        if not parent.is_dir():
            raise ArgumentError("--plot", "a file path in an existing folder", f"{args.plot} (no folder {parent})")
    report = getattr(args, "report", None)
    if report and not Path(report).resolve().parent.is_dir():
        raise ArgumentError("--report", "a file path in an existing folder",
                            f"{report} (no folder {Path(report).resolve().parent})")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command in ("generate", "profile") and args.sinks and args.window is None:
        ap.error("--sinks needs --window")
    try:
        preflight(args)
        if args.command in ("generate", "analyze-window", "certify"):  # on by default: a second run compiles nothing
            folder = compile_cache.enable_compile_cache(args.compile_cache)
            # and traces nothing: the lowered programs beside it (program_cache.py), for this run only
            with program_cache.enabled(None if folder is None else folder / program_cache.SUBDIR):
                return args.func(args)
        return args.func(args)
    except QwenMTPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: end cleanly, no traceback (convert's save leaves nothing half written)
        print("\ninterrupted", file=sys.stderr)
        return 130
