"""build_parser (every command, flag, default and help text) and preflight (what a command will need at its end,
checked before any work)."""

from __future__ import annotations

import argparse
from pathlib import Path

from qwen_mtp.compiling import compile_cache
from qwen_mtp.decoding.auto_k import K_AUTO_CANDIDATES
from qwen_mtp.errors import ArgumentError
from qwen_mtp.tools.cli.analyze_cmd import cmd_analyze_window
from qwen_mtp.tools.cli.args import draft_vocab_arg, k_arg, nonneg_int, penalty_arg, pos_int, windows_arg
from qwen_mtp.tools.cli.certify_cmd import cmd_certify
from qwen_mtp.tools.cli.convert_cmd import cmd_convert
from qwen_mtp.tools.cli.generate_cmd import DRAFT_VOCAB_AUTO, cmd_generate
from qwen_mtp.tools.cli.profile_cmd import cmd_profile
from qwen_mtp.tools.cli.serve_cmd import add_serve_command
from qwen_mtp.trunk.state import KV_DTYPE_NAMES


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m qwen_mtp", description="qwen-mtp: Qwen3.5 inference in JAX "
                                 "with the MTP head as speculative drafter")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a text prompt, streaming the decoded text")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--model", default=None, help="checkpoint folder (default: the shipped checkpoints/qwen3_5_small)")
    g.add_argument("--max-new-tokens", type=pos_int, default=128)
    g.add_argument("--k", type=k_arg, default=3, help="drafts per round, 1..16, or 'auto' to time plain and "
                   f"k in {list(K_AUTO_CANDIDATES)} on this machine and use the fastest (default 3)")
    g.add_argument("--window", type=pos_int, default=None, help="Wind-MTP: the draft head attends to the last "
                   "WINDOW positions plus the sinks (default: native full attention)")
    g.add_argument("--sinks", type=nonneg_int, default=0, help="with --window: the first SINKS positions stay "
                   "visible to the draft head (default 0)")
    g.add_argument("--no-spec", action="store_true", help="plain decoding, no MTP drafts")
    g.add_argument("--draft-vocab", type=draft_vocab_arg, default="auto", metavar="N|auto|off", help="the draft "
                   "head scores only the N most frequent token ids (the model folder's draft_vocab_counts.npy); "
                   f"output unchanged. auto (default): {DRAFT_VOCAB_AUTO} when the folder has counts, else off")
    g.add_argument("--quant", choices=["int8", "int4", "fp8"], default=None, help="quantize the weights as they "
                   "load (a Hugging Face checkpoint; python -m qwen_mtp convert saves the result)")
    g.add_argument("--group-size", type=pos_int, default=128, help="with --quant int4: rows of K per scale")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None, help="dtype of the KV caches (trunk "
                   "and draft head); float8_e4m3fn halves their bytes (default: the compute dtype)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=nonneg_int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
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
    a.add_argument("--windows", type=windows_arg, default=windows_arg("16,64,256,1024,native"),
                   help="comma list of windows, 'native' for full attention (default 16,64,256,1024,native)")
    a.add_argument("--sinks", type=nonneg_int, default=4)
    a.add_argument("--k", type=pos_int, default=4)
    a.add_argument("--prompts", type=pos_int, default=4)
    a.add_argument("--prompt-len", type=pos_int, default=512)
    a.add_argument("--max-new-tokens", type=pos_int, default=64)
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
    f.add_argument("--max-new-tokens", type=pos_int, default=64)
    f.add_argument("--k", type=pos_int, default=3, help="drafts per round (default 3)")
    f.add_argument("--window", type=pos_int, default=None, help="Wind-MTP window (default: native)")
    f.add_argument("--sinks", type=nonneg_int, default=0)
    f.add_argument("--no-spec", action="store_true", help="profile plain decoding instead")
    f.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default=None)
    f.add_argument("--repeats", type=pos_int, default=2, help="traced generate calls, a step marker each")
    f.add_argument("--top", type=pos_int, default=15, help="rows of the top-ops table")
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
    add_serve_command(sub)
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
