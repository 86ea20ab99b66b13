"""Where things are: the checkout, the test models, the corpus, the entry points."""

from __future__ import annotations

import sys
from pathlib import Path

from diloco.corpus import TINYSHAKESPEARE

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "tests" / "models" / "llama-2m-fresh"
CORPUS = TINYSHAKESPEARE  # real text shipped with the package: the tests need nothing beside the checkout
TORCHRUN = Path(sys.executable).parent / "torchrun"
DILOCO = Path(sys.executable).parent / "diloco"
