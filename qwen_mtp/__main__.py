"""python -m qwen_mtp ..."""

import sys

from qwen_mtp.tools.cli import main

sys.exit(main())
