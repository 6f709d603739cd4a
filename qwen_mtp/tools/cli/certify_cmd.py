"""`python -m qwen_mtp certify`: run the lossless certificate (tools/certify.py), write its report, exit 1 on a
divergence that is not a near-tie."""

from __future__ import annotations

import sys


def cmd_certify(args) -> int:
    from qwen_mtp.tools.certify import Report, certify, write_report

    report = Report(dtype=args.dtype)
    save = (lambda r: write_report(r, args.report)) if args.report else None  # after every case
    try:
        certify(args.model, configs=args.configs, archs=args.archs, seed=args.seed, dtype=args.dtype,
                max_prompt=args.max_prompt, cases_per_arch=args.cases_per_arch,
                log=lambda line: print(line, flush=True), report=report, on_case=save)
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
