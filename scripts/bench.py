"""Run the benchmark suite; see ``ftbridge-bench --help`` and ``docs/benchmarks.md``.

    .venv/bin/python scripts/bench.py --quick --out runs/bench-quick
    .venv/bin/python scripts/bench.py --only overhead,overlap --reps 5 --steps 100
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftbridge.harness.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
