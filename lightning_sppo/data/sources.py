"""The texts ``sppo-prepare`` tokenises: ``.txt`` files, ``.jsonl`` records and ``.parquet`` rows, in a fixed order.

- ``.txt`` (or any file of another suffix named on the command line): the whole file is one text, UTF-8.
- ``.jsonl``: one JSON object per line; its ``text_field`` (default ``"text"``) is one text. Blank lines are
  skipped; a line that is not an object with a string (or null: skipped) in that field is an error naming the
  file, the line and ``--text-field``.
- ``.parquet``: the ``text_field`` column, read in row batches (pyarrow, the ``parquet`` extra); nulls are skipped.

A directory contributes its ``*.txt``, ``*.jsonl`` and ``*.parquet`` files, recursively, in sorted order. Texts
are then cut into documents (``split``: whole texts, or the blocks between blank lines); empty and
whitespace-only texts are skipped (and counted), and so are blank blocks inside a text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["SUFFIXES", "ReadStats", "input_files", "read_documents"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
"""What a directory contributes; an explicit file of any other suffix is read as text."""

_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # a line break, then one or more blank lines
_PARQUET_ROWS = 8192  # rows per batch read from a Parquet file


@dataclass
class ReadStats:
    """What ``read_documents`` read, for ``sppo-prepare``'s summary."""

    files: int = 0
    texts: int = 0
    """Texts read: files, JSONL records and Parquet rows (nulls excluded)."""
    skipped: int = 0
    """Empty or whitespace-only texts left out (blank blocks inside a text are dropped silently)."""


def input_files(inputs: Sequence[str]) -> list[Path]:
    """The files named by ``inputs`` (files, or directories searched for ``SUFFIXES``), in order."""
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise FileNotFoundError(f"INPUT directory {item!r} has no {', '.join('*' + s for s in SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"INPUT {item!r} not found (a text file or a folder of them)")
    return files


def read_documents(
    files: Sequence[Path], text_field: str = "text", split: Literal["file", "blank-lines"] = "file",
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, str]]:  # fmt: skip
    """``(where, document)`` for the documents of ``files`` in order, lazily; ``where`` names the file, and the line
    or row, for error messages."""
    stats = stats if stats is not None else ReadStats()
    for path in files:
        stats.files += 1
        for where, text in _texts(path, text_field):
            stats.texts += 1
            if not text.strip():
                stats.skipped += 1
            elif split == "blank-lines":
                yield from ((where, piece.strip("\n")) for piece in _BLANK_LINES.split(text) if piece.strip())
            else:
                yield where, text


def _texts(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    if path.suffix == ".jsonl":
        return _jsonl_texts(path, text_field)
    if path.suffix == ".parquet":
        return _parquet_texts(path, text_field)
    return iter([(str(path), _decode(path.read_bytes(), str(path)))])


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 text: {err.reason} at byte {err.start}") from None


def _jsonl_texts(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where} is not a JSON object: {err.msg} at column {err.colno}") from None
            if not isinstance(record, dict) or text_field not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{where} has no {text_field!r} field (it has {fields}); name the field holding the text"
                    " with --text-field"
                )
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{where}: --text-field={text_field!r} holds {type(text).__name__}, not a string")
            yield where, text


def _parquet_texts(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f'reading {path} needs pyarrow: pip install "lightning-sppo[parquet]" (or pip install pyarrow)'
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError: not Parquet, or cut short
        raise ValueError(f"{path} is not a readable Parquet file ({' '.join(str(error).split())}).") from error
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ValueError(f"{path} has no column {text_field!r} (it has {columns}); name it with --text-field")
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            where, row = f"{path} row {row}", row + 1
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{where}: column --text-field={text_field!r} holds {type(text).__name__}, not str")
            yield where, text
