"""Where the repository is, for tests that start processes or read files from it."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
