"""``python -m moe_placement`` runs the moe-placement CLI (the same as the installed ``moe-placement``)."""

import sys

try:
    from moe_placement.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the packages load: the same one line and exit code as later
    print("moe-placement: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
