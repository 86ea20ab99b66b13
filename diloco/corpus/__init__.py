"""Text shipped with the package, so demos and tests train on real text offline (see README.md here)."""

from pathlib import Path

TINYSHAKESPEARE = Path(__file__).with_name("tinyshakespeare.txt")  # public domain; source in README.md
