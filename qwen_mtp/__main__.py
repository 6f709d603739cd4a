"""python -m qwen_mtp ..."""

import sys

from .cli import main

sys.exit(main())
