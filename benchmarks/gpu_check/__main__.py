"""`python benchmarks/gpu_check [flags]`: the GPU check as a command (the package's docstring says what it does).

Run as a folder, Python puts this folder itself first on sys.path and imports this file as a plain script;
that entry becomes benchmarks/ instead (as for the one-file script), so the package imports as `gpu_check`
(which puts the repository's root on sys.path) and no module of it shadows a top-level one."""

import os
import sys

if __name__ == "__main__":
    if not __package__:  # python benchmarks/gpu_check (or .../__main__.py), not python -m
        here = os.path.dirname(os.path.abspath(__file__))
        if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:
            sys.path[0] = os.path.dirname(here)
        else:
            sys.path.insert(0, os.path.dirname(here))
        from gpu_check.cli import main
    else:
        from .cli import main
    sys.exit(main())
