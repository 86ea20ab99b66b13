"""A model folder's weights as safetensors files, written one tensor at a time.

``safetensors.torch.save_file`` takes a dict of every tensor of a file and turns each into bytes before it writes
(``save_pretrained`` goes through it): exporting a model that way holds it twice on the writing rank. The format
is simple enough to stream: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes in that order. Every shape is known before the first tensor is gathered (the model's
own), so the headers are written first and each tensor goes straight to its place as it comes. Over
``MAX_FILE_BYTES`` the weights are split into ``model-0000i-of-0000n.safetensors`` with the index
``from_pretrained`` reads, as ``save_pretrained`` names them.

Each file is written under a ``.partial`` name and renamed once complete: an interrupted export leaves no file that
looks whole. Plain Python over tensors; nothing distributed.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

MAX_FILE_BYTES = 5 * 1000**3  # per file, as the Hub's models are usually split
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PARTIAL = ".partial"
SPLIT = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
ALIGN = 8  # the header is padded with spaces so the bytes that follow start 8-byte aligned

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor's place: its file and byte range there (from the end of the header)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int


def plan(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_file_bytes: int = MAX_FILE_BYTES) -> list[Entry]:
    """Each tensor's file and byte range, in the given order: a file takes tensors until the next would take it over
    `max_file_bytes` (a tensor bigger than that gets a file of its own)."""
    files: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        if files[-1] and used + size > max_file_bytes:
            files.append([])
            used = 0
        files[-1].append((name, dtype, tuple(shape), size))
        used += size
    entries = []
    for number, members in enumerate(files, 1):
        file = SINGLE if len(files) == 1 else f"model-{number:05d}-of-{len(files):05d}.safetensors"
        offset = 0
        for name, dtype, shape, size in members:
            entries.append(Entry(name, dtype, shape, file, offset, offset + size))
            offset += size
    return entries


def header(entries: list[Entry]) -> bytes:
    """The length-prefixed JSON header of one file's `entries`."""
    described: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for e in entries:
        described[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


class WeightFiles:
    """Writes the tensors of `entries` (``plan``) into `folder`, each handed to `write` in the planned order."""

    def __init__(self, folder: Path, entries: list[Entry]) -> None:
        self.folder, self.entries = folder, entries
        self._next = 0
        self._file: BinaryIO | None = None
        self._name = ""
        self._written: list[str] = []
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(f"expected {entry.name} {entry.dtype} {list(entry.shape)}, got {name} {tensor.dtype} "
                             f"{list(tensor.shape)}")  # fmt: skip
        if entry.file != self._name:
            self._close()
            self._open(entry.file)
        assert self._file is not None
        data = tensor.detach().cpu().contiguous().reshape(-1)
        if data.numel():  # its own bytes, no copy (bfloat16 and float8 have no numpy dtype: viewed as bytes)
            self._file.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def finish(self) -> list[str]:
        """Close the last file and write the index when there are several; the files written, in order."""
        if self._next != len(self.entries):
            missing = self.entries[self._next].name
            raise ValueError(f"{len(self.entries) - self._next} tensors were not written, from {missing}")
        self._close()
        keep = set(self._written)
        if len(self._written) > 1:
            keep.add(INDEX)
            index = {
                "metadata": {"total_size": sum(e.end - e.begin for e in self.entries)},
                "weight_map": {e.name: e.file for e in self.entries},
            }
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for path in self.folder.iterdir():  # a former export's, split otherwise: from_pretrained would read it
            if (path.name in (SINGLE, INDEX) or SPLIT.fullmatch(path.name)) and path.name not in keep:
                path.unlink()
        return list(self._written)

    def _open(self, file: str) -> None:
        self._name = file
        self._file = (self.folder / (file + PARTIAL)).open("wb")
        self._file.write(header([e for e in self.entries if e.file == file]))

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        os.replace(self.folder / (self._name + PARTIAL), self.folder / self._name)
        self._written.append(self._name)
