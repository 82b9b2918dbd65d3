"""Run the main training job under injected failures; see ``ftbridge-chaos --help``.

    .venv/bin/python scripts/chaos.py --quick --out chaos-report
"""

import sys

from ftbridge.harness.chaos.cli import main

if __name__ == "__main__":
    sys.exit(main())
