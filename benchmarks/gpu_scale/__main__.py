"""python benchmarks/gpu_scale [flags]: see the package docstring."""

import os
import sys

# the models and a 1M-position cache need most of the device (jax's default lets it allocate 75%)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--compile-for" in sys.argv:  # the CUDA plugin registers without a GPU (qwen_mtp.tools.gpu_compile.prepare)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: this package
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: qwen_mtp, kernels_pallas

from gpu_scale.cli import main

if __name__ == "__main__":
    sys.exit(main())
