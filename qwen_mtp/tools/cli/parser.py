"""build_parser (every command, flag, default and help text) and preflight (what a command will need at its end,
checked before any work).

Every option's help line shows its default: usage.Help appends "(default: X)" where the text does not say it
already; a default of None is said in words in the help text itself (what happens without the flag)."""

from __future__ import annotations

from pathlib import Path

from qwen_mtp.compiling import compile_cache
from qwen_mtp.decoding.auto_k import K_AUTO_CANDIDATES
from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading.folder import CARRIED_FILES, folder_problem
from qwen_mtp.tools.cli.analyze_cmd import cmd_analyze_window
from qwen_mtp.tools.cli.args import (
    draft_vocab_arg,
    int_arg,
    k_arg,
    nonneg_float,
    nonneg_int,
    penalty_arg,
    pos_int,
    top_p_arg,
    windows_arg,
)
from qwen_mtp.tools.cli.certify_cmd import cmd_certify
from qwen_mtp.tools.cli.convert_cmd import cmd_convert
from qwen_mtp.tools.cli.generate_cmd import (
    DRAFT_VOCAB_AUTO,
    TREE_FORMS,
    cmd_generate,
    tree_arg,
)
from qwen_mtp.tools.cli.profile_cmd import cmd_profile
from qwen_mtp.tools.cli.serve_cmd import add_serve_command
from qwen_mtp.tools.cli.usage import PROG, FlagError, Parser
from qwen_mtp.trunk.state import KV_DTYPE_NAMES

CERTIFY_MINUTES_PER_CONFIG = 0.4  # the shipped model on a 2-core CPU machine: 50 configurations in about 20 min


def _command(sub, name: str, summary: str, description: str):
    """A command's parser: `summary` on the command list, `summary` + `description` atop its own -h page."""
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}")


def build_parser():
    ap = Parser(prog=PROG, description="qwen-mtp: Qwen3.5 inference in JAX with the MTP head as speculative "
                "drafter. Each command's own page, its options and their defaults: python -m qwen_mtp COMMAND -h")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "model folder: config.json, the weights (*.safetensors or a convert output) and tokenizer.json " \
                 "(default: the shipped checkpoints/qwen3_5_small)"
    cache_help = (f"jax's persistent compilation cache folder, so a second run compiles nothing (default: "
                  f"${compile_cache.ENV}, else ~/.cache/qwen_mtp/jax; 'off' disables it)")

    g = _command(sub, "generate", "continue a text prompt, streaming the decoded text",
                 "Loads the model, compiles every program ahead of time (read back from the compile cache on a "
                 "second run), streams the continuation and ends with one stats line: speed, and with speculation "
                 "the acceptance length AL and the per-position acceptance alpha_j.")
    g.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    g.add_argument("--model", default=None, metavar="DIR", help=model_help)
    g.add_argument("--max-new-tokens", type=pos_int, metavar="N", default=128,
                   help="tokens to generate at most (stops at EOS)")
    g.add_argument("--k", type=k_arg, default=None, help="drafts per round, 1..16, or 'auto' to time plain and "
                   f"k in {list(K_AUTO_CANDIDATES)} on this machine and use the fastest (default: the speculation "
                   "plan measured once per machine, model and settings and cached, plain where speculation is slower)")
    g.add_argument("--window", type=pos_int, default=None, help="Wind-MTP: the draft head attends to the last "
                   "WINDOW positions plus the sinks (default: native full attention)")
    g.add_argument("--sinks", type=nonneg_int, default=0, help="with --window: the first SINKS positions stay "
                   "visible to the draft head; may exceed the window (they are separate)")
    g.add_argument("--tree", type=tree_arg, default=None, metavar="SHAPE", help="tree drafts: several "
                   "continuations verified in one forward, output unchanged; SHAPE is " + TREE_FORMS + " (the "
                   "top choices of the most probable nodes, BUDGET nodes kept); its depth is k. Default: a chain of "
                   "k drafts")
    g.add_argument("--no-spec", action="store_true", help="plain decoding, no MTP drafts (default: speculative)")
    g.add_argument("--draft-vocab", type=draft_vocab_arg, default="auto", metavar="N|auto|off", help="the draft "
                   "head scores only the N most frequent token ids (the model folder's draft_vocab_counts.npy); "
                   f"output unchanged. auto (default): {DRAFT_VOCAB_AUTO} when the folder has counts, else off")
    g.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None, help="quantize the weights as they "
                   "load (a Hugging Face checkpoint; python -m qwen_mtp convert saves the result) (default: as "
                   "stored)")
    g.add_argument("--group-size", type=pos_int, metavar="G", default=128,
                   help="with --quant int4: rows of K per scale, a power of two")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None, help="dtype of the KV caches (trunk "
                   "and draft head); float8_e4m3fn halves their bytes (default: the compute dtype)")
    g.add_argument("--temperature", type=nonneg_float, metavar="T", default=0.0,
                   help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=top_p_arg, metavar="P", default=1.0, help="nucleus sampling: keep the smallest "
                   "set of tokens whose probability reaches P, in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="keep the K most probable tokens; 0 = off")
    g.add_argument("--seed", type=int_arg, default=0, help="random seed of sampling (unused when greedy)")
    g.add_argument("--repetition-penalty", type=penalty_arg, default=None, metavar="R", help="divide the logit of "
                   "every id already in the text by R when positive, multiply when negative (Hugging Face's rule; 1 = "
                   "off; speculative output stays exactly the plain output). Default: the model folder's "
                   "generation_config.json repetition_penalty, else 1")
    g.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard the model over a device mesh: "
                   "tensor parallel over M devices, batch rows over D (the first D x M devices; an axis left out "
                   "has size 1, model=-1 takes the devices left). Default: one device, or model=-1 with several "
                   "processes")
    g.add_argument("--distributed", action="store_true", help="multi-process job (one process per host): "
                   "jax.distributed.initialize() first, the cluster found from SLURM / Open MPI / Cloud TPU or "
                   "from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; run the same command on every "
                   "process, process 0 prints (default: one process)")
    g.add_argument("--stats-to-stderr", action="store_true", help="print the stats line on stderr, so stdout is "
                   "the text alone (default: stdout)")
    g.add_argument("--no-warmup", action="store_true", help="time the first call too (it includes compiling); "
                   "by default every program is compiled ahead of time, running nothing, so tok/s is the "
                   "steady-state speed")
    g.add_argument("--compile-cache", default=None, metavar="DIR|off", help=cache_help)
    g.set_defaults(func=cmd_generate)

    a = _command(sub, "analyze-window", "Wind-MTP: dose-response over draft windows, alpha_j with Wilson "
                 "intervals, A/B probe, attention mass",
                 "Runs greedy speculative decoding with the draft head windowed to each of --windows (every run "
                 "checked equal to plain greedy) and prints AL / TPOT per window, alpha_j with 95% Wilson "
                 "intervals, how often the windowed head keeps the native top-1, and the attention mass inside "
                 "the window.")
    a.add_argument("--model", default=None, metavar="DIR", help=model_help + "; it needs an MTP head")
    a.add_argument("--windows", type=windows_arg, default=windows_arg("16,64,256,1024,native"),
                   help="comma list of windows, 'native' for full attention")
    a.add_argument("--sinks", type=nonneg_int, default=4, help="first positions every window keeps visible")
    a.add_argument("--k", type=pos_int, default=4, help="drafts per round")
    a.add_argument("--prompts", type=pos_int, default=4, help="prompts cut from the text")
    a.add_argument("--prompt-len", type=pos_int, default=512, help="tokens per prompt")
    a.add_argument("--max-new-tokens", type=pos_int, metavar="N", default=64,
                   help="tokens generated per prompt and window")
    a.add_argument("--prompt-file", default=None, help="text to cut prompts from (default: the held-out stdlib "
                   "files the shipped model never saw)")
    a.add_argument("--plot", default=None, metavar="PNG", help="save a PNG of AL/TPOT and alpha_j per window here "
                   "(default: no plot)")
    a.add_argument("--compile-cache", default=None, metavar="DIR|off", help=cache_help)
    a.set_defaults(func=cmd_analyze_window)

    c = _command(sub, "convert", "quantize a checkpoint (Hugging Face, or one convert wrote) into an orbax "
                 "checkpoint folder that generate --model and qwen_mtp.load read directly",
                 "Quantizes tensor by tensor, bit for bit as generate --quant would as it loads, and copies beside "
                 f"the weights config.json and each of these files SRC has: {', '.join(CARRIED_FILES)}. Other "
                 "files (eval reports, training logs) are not the model's and stay behind; convert lists them.")
    c.add_argument("src", metavar="SRC", help="source checkpoint folder")
    c.add_argument("dst", metavar="DST", help="folder to write (must not exist, be empty, or --overwrite a "
                   "converted one)")
    c.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None,
                   help="weight format (default: none, the tensors are only cast to --dtype)")
    c.add_argument("--group-size", type=pos_int, metavar="G", default=128,
                   help="int4: rows of K per scale, a power of two")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the tensors kept unquantized")
    c.add_argument("--quant-lm-head", action="store_true", help="quantize the lm_head too (a tied one as a "
                   "quantized copy of embed^T) (default: lm_head kept in --dtype)")
    c.add_argument("--keep-mtp-bf16", action="store_true", help="keep the MTP head unquantized, in --dtype "
                   "(default: quantized like the trunk)")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it is a folder convert wrote "
                   "(default: refuse an existing non-empty DST)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on stderr)")
    c.set_defaults(func=cmd_convert)

    f = _command(sub, "profile", "trace generate calls with jax.profiler and print the time of each phase "
                 "(prefill, draft, verify, accept, commit, rollback, refill) and stage from the trace",
                 "Writes the trace into --logdir, by default ./traces in the current folder (created if "
                 "missing), and prints where it went and how to open it with xprof.")
    f.add_argument("prompt", metavar="PROMPT", nargs="?", default="import os\nimport sys\n\n\ndef main(argv):\n",
                   help="the text to continue (default: a few lines of Python)")
    f.add_argument("--model", default=None, metavar="DIR", help=model_help)
    f.add_argument("--max-new-tokens", type=pos_int, metavar="N", default=64, help="tokens per traced call")
    f.add_argument("--k", type=pos_int, default=3, help="drafts per round")
    f.add_argument("--window", type=pos_int, default=None, help="Wind-MTP window (default: native)")
    f.add_argument("--sinks", type=nonneg_int, default=0, help="with --window: first positions kept visible")
    f.add_argument("--no-spec", action="store_true", help="profile plain decoding instead (default: speculative)")
    f.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None, help="dtype of the KV caches "
                   "(default: the compute dtype)")
    f.add_argument("--repeats", type=pos_int, default=2, help="traced generate calls, a step marker each")
    f.add_argument("--top", type=pos_int, default=15, help="rows of the top-ops table")
    f.add_argument("--logdir", default="traces", help="folder the trace is written into (default: ./traces, in "
                   "the current folder); give the same folder to xprof --logdir")
    f.set_defaults(func=cmd_profile)

    r = _command(sub, "certify", "the lossless certificate: plain vs speculative greedy over random "
                 "configurations (and random tiny architectures); exit 1 on a divergence that is not a "
                 "bf16 near-tie",
                 f"The default, 50 configurations on the shipped model, takes about "
                 f"{round(50 * CERTIFY_MINUTES_PER_CONFIG)} minutes on a 2-core CPU machine: --configs sets how "
                 "many.")
    r.add_argument("--model", default=None, metavar="DIR",
                   help="checkpoint folder with an MTP head (default: the shipped model)")
    r.add_argument("--configs", type=nonneg_int, default=50, help="random configurations on the model (default "
                   f"50: about {round(50 * CERTIFY_MINUTES_PER_CONFIG)} minutes on a 2-core CPU machine)")
    r.add_argument("--archs", type=nonneg_int, default=0, help="random tiny architectures")
    r.add_argument("--cases-per-arch", type=pos_int, default=2, help="configurations run on each random "
                   "architecture")
    r.add_argument("--seed", type=int_arg, default=0, help="seed of the random configurations and architectures")
    r.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype of both "
                   "runs (bfloat16: near-ties are reported, not failed)")
    r.add_argument("--max-prompt", type=pos_int, default=512, help="longest prompt row drawn")
    r.add_argument("--report", default=None, metavar="FILE", help="write the report as JSON (default: none)")
    r.add_argument("--compile-cache", default=None, metavar="DIR|off", help=cache_help)
    r.set_defaults(func=cmd_certify)
    add_serve_command(sub)
    ap.commands = sub.choices  # {command: its parser}: main reports a command's errors in its name
    return ap


def preflight(args) -> None:
    """What a command will need at its end, checked before any work: the model folder given (it exists and is a
    folder), the optional packages of the features asked for (extras.py) and the folders outputs are written
    into."""
    from qwen_mtp.extras import require

    for flag, path in (("--model", getattr(args, "model", None)), ("SRC", getattr(args, "src", None))):
        problem = None if path is None else folder_problem(path)
        if problem:
            raise FlagError(flag, problem)
    if getattr(args, "plot", None):
        require("--plot", "plot")
        parent = Path(args.plot).resolve().parent
        if not parent.is_dir():
            raise ArgumentError("--plot", "a file path in an existing folder", f"{args.plot} (no folder {parent})")
    report = getattr(args, "report", None)
    if report and not Path(report).resolve().parent.is_dir():
        raise ArgumentError("--report", "a file path in an existing folder",
                            f"{report} (no folder {Path(report).resolve().parent})")
