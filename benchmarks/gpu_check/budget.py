"""--budget: the end of the run's time (`set_deadline`), the check cases and sections make before starting
(`out_of_time`), one section run so that its failure or exception does not hide the others (`section`), and the
summary that closes the output (`summary`, the exit code)."""

import time

from .common import one_line

# the end of the run's time budget (--budget), a perf_counter() value; None: no budget. Case loops stop at it and
# say so; sections not started by then are skipped and named.
_DEADLINE = None


def set_deadline(t0, seconds):
    """Start the --budget: `seconds` from the perf_counter() value t0 (None: no budget, nothing is skipped)."""
    global _DEADLINE
    _DEADLINE = None if seconds is None else t0 + seconds


def out_of_time(label, need=0.0):
    """True (and one line saying so) once fewer than `need` seconds of the --budget are left (need 0: once it is
    spent): the caller skips `label` and what follows it."""
    left = None if _DEADLINE is None else _DEADLINE - time.perf_counter()
    if left is None or (left >= need if need else left > 0):
        return False
    why = f"{max(0.0, left):.0f} s of the --budget left (it needs about {need:.0f})" if need else \
        "the --budget is spent"
    print(f"{label}: skipped, {why}", flush=True)
    return True


def section(results, name, fn, *, min_left=0.0):
    """Run one part of the check: an exception fails it (one line, then the next part runs); with a --budget a
    part needing `min_left` seconds that no longer fit is skipped and named. Appends (name, failures | None,
    seconds) to `results`."""
    if out_of_time(f"== {name}", need=min_left):
        results.append((name, None, 0.0))
        return
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        failed = fn()
    except Exception as e:  # noqa: BLE001 - one part that raises must not hide the others
        import traceback

        traceback.print_exc(limit=4)
        print(f"{name}: FAIL {one_line(e)}", flush=True)
        failed = 1
    results.append((name, failed, time.perf_counter() - t))


def summary(results, t0):
    """The summary of the parts that closes the output; returns the exit code (1 if any part failed)."""
    print(f"\n== summary ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, failed, secs in results:
        state = "skipped" if failed is None else "OK" if not failed else f"FAIL ({failed})"
        print(f"  {name:44s} {state:10s} {secs:6.0f} s", flush=True)
    failures = sum(f or 0 for _, f, _ in results)
    skipped = sum(f is None for _, f, _ in results)
    print(f"{'OK' if not failures else f'FAIL ({failures})'} in {time.perf_counter() - t0:.0f} s"
          + (f", {skipped} of {len(results)} parts skipped for the --budget" if skipped else ""), flush=True)
    return 1 if failures else 0
