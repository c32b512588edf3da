"""``python -m nvoffload``: the command line (see :mod:`nvoffload.cli`)."""

import sys

from nvoffload.cli import main

sys.exit(main())
