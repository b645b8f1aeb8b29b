"""``python -m placement`` runs the moe-placement CLI."""

import sys

from placement.cli import main

sys.exit(main())
