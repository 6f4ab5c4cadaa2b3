"""``python -m awa_fast.cli``: the same command line as ``awa-fast``."""

from awa_fast.cli import main

raise SystemExit(main())
