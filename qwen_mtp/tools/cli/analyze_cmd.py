"""`python -m qwen_mtp analyze-window`: Wind-MTP dose-response over draft windows, alpha_j intervals, the A/B
probe and attention mass (tools/analysis.py does the measuring; this prints it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qwen_mtp.decoding.stats import fmt
from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading.folder import default_model_path, load_tokenizer


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
