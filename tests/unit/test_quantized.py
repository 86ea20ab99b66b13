"""What a quantized base needs before any model is built: bitsandbytes, and a clear line without it."""

from __future__ import annotations

import sys

import pytest
import torch

from diloco import quantized
from diloco.cli.app import as_flags
from diloco.errors import FieldError


@pytest.mark.parametrize("bits", [4, 8])
def test_without_bitsandbytes_a_quantized_base_is_one_line_naming_its_flag(monkeypatch: pytest.MonkeyPatch,
                                                                          bits: int) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an import of a missing package meets
    with pytest.raises(FieldError) as caught:
        quantized.load_quantized("no-model-needed", 0, None, bits, torch.float32, torch.device("cpu"))
    line = str(as_flags(caught.value))
    assert line.startswith(f"--load-in-{bits}bit: bitsandbytes could not be imported (") and "\n" not in line
