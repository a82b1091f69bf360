"""Entry point of ``python -m a4prefill``."""

import sys

from a4prefill.cli import main

sys.exit(main())
