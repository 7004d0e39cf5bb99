"""``python -m pytest_transformers_opt advise ...``: the same as the ``pytest-opt`` console script."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
