"""``python -m hpcps`` is the same as the ``hpcps`` console script."""

import sys

from hpcps.cli import main

sys.exit(main())
