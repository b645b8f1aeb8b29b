"""``python -m cli`` runs the moe-placement CLI."""

import sys

from cli.main import main

sys.exit(main())
