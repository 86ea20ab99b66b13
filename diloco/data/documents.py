"""The documents of a corpus, as text: local .txt, .jsonl and .parquet files (or a folder of them), or a hub
dataset's train split, read in pieces of a few MB whatever the file's size (`pieces`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco import hub
from diloco.errors import FieldError, first_line

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
PIECE_BYTES = 4 << 20  # a .txt file is read this much at a time, cut at the last line end
PARQUET_ROWS = 1024  # rows of a .parquet file read at a time


@dataclass(frozen=True)
class Piece:
    """Text of one document, or part of one (`ends` on its last part); `nbytes`: how far it moved through the
    source, in bytes of its files (for a progress figure)."""

    text: str
    ends: bool
    nbytes: int


def dataset_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise FieldError(f"{{dataset}} {path}: unsupported file type (use {', '.join(TEXT_SUFFIXES)})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FieldError(f"{{dataset}} {path}: the folder holds no {', '.join(TEXT_SUFFIXES)} file")
    return files


def pieces(dataset: Path, config: str | None = None) -> Iterator[Piece]:
    """Every document of `dataset` (a local file or folder, else a hub id), in pieces of at most a few MB: each
    .txt file is one document, each .jsonl line and .parquet row one. Raises FieldError (naming --dataset) for a
    file it cannot read as such."""
    if hub.is_hub_id(str(dataset)):
        for text in hub_documents(str(dataset), config):
            yield Piece(text, True, len(text))
        return
    for file in dataset_files(dataset):
        try:
            yield from file_pieces(file)
        except (OSError, json.JSONDecodeError, UnicodeError) as e:
            raise FieldError(f"{{dataset}} {file}: could not read it ({first_line(e)})") from None


def file_pieces(path: Path) -> Iterator[Piece]:
    if path.suffix == ".txt":
        yield from text_pieces(path)
    elif path.suffix == ".jsonl":
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    text = _text_field(json.loads(line), f"{path}:{number}")
                    yield Piece(text, True, len(line))
    else:
        yield from parquet_pieces(path)


def text_pieces(path: Path) -> Iterator[Piece]:
    """A .txt file as one document, read `PIECE_BYTES` at a time and cut after the last line end (or, in a line
    longer than that, before a UTF-8 character), decoded as a text-mode read of the whole file would be.
    A file holding a NUL byte in its first piece is not text (FieldError)."""
    with path.open("rb") as f:
        carry, first = b"", True
        while block := f.read(PIECE_BYTES):
            if first and (nul := block.find(b"\0")) >= 0:
                raise FieldError(f"{{dataset}} {path}: not a text file (a NUL byte at offset {nul})")
            first, data = False, carry + block
            cut = data.rfind(b"\n") + 1 or _char_start(data)
            carry = data[cut:]
            if cut:
                yield Piece(_decode(data[:cut]), False, cut)
        yield Piece(_decode(carry), True, len(carry))


def _decode(data: bytes) -> str:
    """As a text-mode read decodes: undecodable bytes as U+FFFD, line ends as \\n."""
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _char_start(data: bytes) -> int:
    """How much of `data` ends on a whole UTF-8 character: all of it, or up to its last character's first byte
    when that character is cut off (continuation bytes are 0b10xxxxxx)."""
    lead = len(data) - 1
    while lead > 0 and len(data) - lead < 4 and data[lead] & 0xC0 == 0x80:
        lead -= 1
    if lead < 0 or data[lead] < 0xC0:
        return len(data)
    length = 2 if data[lead] < 0xE0 else 3 if data[lead] < 0xF0 else 4
    return len(data) if len(data) - lead >= length else lead


def parquet_pieces(path: Path) -> Iterator[Piece]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    columns = table.schema_arrow.names
    if "text" not in columns:
        raise FieldError(f"{{dataset}} {path}: no 'text' column (columns: {', '.join(columns)})")
    rows, size = max(table.metadata.num_rows, 1), path.stat().st_size
    for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=["text"]):
        texts = [text for text in batch.column(0).to_pylist() if text]
        share = size * batch.num_rows // rows  # its share of the file: compressed, so in rows
        for i, text in enumerate(texts):
            yield Piece(text, True, share if i == len(texts) - 1 else 0)


def _text_field(record: object, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise FieldError(f"{{dataset}} {where}: each JSON line needs a string 'text' field")
    return record["text"]


def hub_documents(name: str, config: str | None = None) -> Iterator[str]:
    """The `text` column of a hub dataset's train split (of configuration `config`), through `datasets` (imported
    only here: it is slow to import). A snapshot in the hub cache (`hf download --repo-type dataset`) is read as a
    local folder, since `datasets` does not look there offline (a configuration is then its subfolder, as hub
    repos such as wikitext lay them out); otherwise `datasets` finds its own prepared cache, or streams the split
    from the hub (`streamed`: nothing downloaded whole; it goes into the token store as it comes)."""
    import datasets

    datasets.disable_progress_bars()  # a bar per rank and file only clutters the run's log
    if hub.cached_snapshot(name, "dataset") is None and not hub.in_datasets_cache(name):
        yield from streamed(name, config)
        return
    snapshot = None
    try:
        # under the machine's lock: a rank that downloads the id fills its snapshot folder file by file
        with hub.download_lock(name, "dataset"):
            snapshot = hub.cached_snapshot(name, "dataset")
            if snapshot is None:
                source, options = name, {"name": config}
            elif config is not None and (snapshot / config).is_dir():
                source, options = str(snapshot), {"data_dir": config}
            else:
                source, options = str(snapshot), {"name": config}
            table = datasets.load_dataset(source, split="train", **options)
    except Exception as e:  # noqa: BLE001 - datasets, huggingface_hub, httpx and pyarrow each raise their own types
        if snapshot is None and not hub.in_datasets_cache(name):
            raise hub.not_found("dataset", name, first_line(e)) from None
        which = f"the train split of configuration {config}" if config else "its train split"
        raise FieldError(f"{{dataset}} {name}: could not load {which} ({first_line(e)})") from None
    if "text" not in table.column_names:
        raise FieldError(f"{{dataset}} {name}: no 'text' column (columns: {', '.join(table.column_names)})")
    yield from (text for text in table["text"] if text)


def streamed(name: str, config: str | None) -> Iterator[str]:
    """The train split's `text` column row by row from the hub (`load_dataset(..., streaming=True)`); an id the hub
    cannot serve (offline, unknown) is `hub.not_found`, a stream that breaks off one line naming --dataset."""
    import datasets

    rows = 0
    try:
        for row in datasets.load_dataset(name, name=config, split="train", streaming=True):
            if rows == 0 and "text" not in row:
                raise FieldError(f"{{dataset}} {name}: no 'text' column (columns: {', '.join(row)})")
            rows += 1
            if row["text"]:
                yield row["text"]
    except FieldError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets, huggingface_hub, httpx and pyarrow each raise their own types
        if rows == 0:
            raise hub.not_found("dataset", name, first_line(e)) from None
        raise FieldError(f"{{dataset}} {name}: the stream from the hub broke off after {rows} rows "
                         f"({first_line(e)})") from None  # fmt: skip
