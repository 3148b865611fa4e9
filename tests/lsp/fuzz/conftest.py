"""The fuzz and drift suites share the stdio client and the client-side models one level up."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
