"""The optional extras (pyproject.toml [project.optional-dependencies]) and the check that a feature's packages are
installed before any work starts: a missing one is a MissingExtraError naming the feature and the extra, which the
command line prints as one line with exit status 2.

    plot       matplotlib                   analyze-window --plot
    train      optax, matplotlib            python -m checkpoints.train_small (retraining the shipped model; the
                                            loss-curve plot, --no-plot to go without matplotlib)
    notebooks  nbclient, nbformat, ipykernel, matplotlib
                                            executing notebooks/*.ipynb (python -m notebooks.run)
    serve      fastapi, uvicorn, jinja2, prometheus_client
                                            python -m qwen_mtp serve (checked by tools/cli/serve_cmd.py)
    test       the above, pytest, torch, transformers, hypothesis, openai, httpx, ...
                                            the test suite and the transformers benchmarks
    sm90       triton                       the sm_90 compile tests (CI requires it)
    bench      tokamax, qwix                the library baselines benchmarks/bench_moe.py and benchmarks/gpu_check
                                            time beside ours (each skipped, saying why, where it does not import)
    cuda       jax[cuda12]                  running on an NVIDIA GPU
"""

from __future__ import annotations

import importlib

from qwen_mtp.errors import MissingExtraError

EXTRAS = {
    "plot": ("matplotlib",),
    "train": ("optax", "matplotlib"),
    "notebooks": ("nbclient", "nbformat", "ipykernel", "matplotlib"),
    "test": ("pytest", "torch", "transformers", "hypothesis"),
    "bench": ("tokamax", "qwix"),
}


def missing(modules) -> list:
    """The modules of `modules` that cannot be imported."""
    out = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            out.append(m)
    return out


def tokamax_or_reason(hint: str = "pip install -e \".[bench]\""):
    """The tokamax module (the `bench` extra: a library baseline beside our kernels), or one line saying why it is
    not used: not installed (with `hint`), or installed but failing to import. tokamax reads absl flags at call
    time; a benchmark's own argv is not theirs, so they are marked parsed here."""
    try:
        import tokamax
    except ImportError:
        return f"not installed ({hint})"
    except Exception as e:  # noqa: BLE001 - installed but broken (a dependency of another version): say why
        return f"does not import: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def require(feature: str, extra: str, modules=None) -> None:
    """Raise MissingExtraError unless every module of `modules` (default: all of the extra's) imports."""
    gone = missing(EXTRAS[extra] if modules is None else modules)
    if gone:
        raise MissingExtraError(feature, extra, gone)


def run_script(main, argv=None) -> int:
    """A script's entry point (`sys.exit(run_script(main))`): bad input and missing extras, this package's typed
    errors, end in one line on stderr and exit status 2, not a traceback; Ctrl-C in status 130."""
    import sys

    from qwen_mtp.errors import QwenMTPError

    try:
        return main(argv) or 0
    except QwenMTPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
