"""`python -m qwen_mtp convert SRC DST`: quantize / cast a checkpoint into an orbax folder, with a progress bar,
a before / after size line and the files copied beside the weights (and those left behind)."""

from __future__ import annotations

import sys
import time


def cmd_convert(args) -> int:
    from tqdm import tqdm

    from qwen_mtp.loading.convert import carried_files, convert

    def bar(total):  # over the tensors quantized / cast, once the source has loaded
        return tqdm(total=total, desc="quantize" if args.quant else "convert", unit="tensor", file=sys.stderr,
                    disable=args.no_progress)

    t = time.perf_counter()
    before, model = convert(args.src, args.dst, dtype=args.dtype, quant=args.quant, group_size=args.group_size,
                            quant_lm_head=args.quant_lm_head, quant_mtp=not args.keep_mtp_bf16,
                            overwrite=args.overwrite, progress=bar)
    after = model.weight_bytes()
    print(model.describe_quant())
    print(f"weights: {before / 2**20:.2f} MiB in {args.dtype} -> {after['total'] / 2**20:.2f} MiB "
          f"({after['quantized'] / 2**20:.2f} quantized + {after['plain'] / 2**20:.2f} plain), "
          f"{after['total'] / before:.3f} of {args.dtype}")
    copied, left = carried_files(args.src)
    print(f"copied beside the weights: {', '.join(copied)}"
          + (f"; left behind (not read by qwen_mtp): {', '.join(left)}" if left else ""))
    print(f"wrote {args.dst} in {time.perf_counter() - t:.1f}s; run it with: python -m qwen_mtp generate "
          f"--model {args.dst} PROMPT")
    return 0
