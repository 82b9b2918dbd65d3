"""Run one ftbridge replica group without installing the package: ``python scripts/ftbridge_run.py ...``."""
import os, sys  # noqa: E401
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ftbridge.launcher import main  # noqa: E402
sys.exit(main())
