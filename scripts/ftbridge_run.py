"""Run one ftbridge replica group without installing the package: ``python scripts/ftbridge_run.py ...``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ftbridge.launch.run import main

sys.exit(main())
