"""``python -m fitserve.cli``."""

from fitserve.cli.main import main

raise SystemExit(main())
