"""`python -m fxamp ...`: see fxamp/cli.py."""

from fxamp.cli import main

raise SystemExit(main())
