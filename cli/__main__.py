"""``python -m cli`` runs the moe-placement CLI."""

import sys

try:
    from cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the packages load: the same one line and exit code as later
    print("moe-placement: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
