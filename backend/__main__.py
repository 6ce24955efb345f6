"""``python -m backend`` is the ``rebalancer`` command."""

from backend.cli import main

raise SystemExit(main())
