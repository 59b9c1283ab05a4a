"""``python -m sidecar`` is ``cancel-sidecar``."""

import sys

from sidecar.cli import main

sys.exit(main())
