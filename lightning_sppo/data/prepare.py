"""``sppo-prepare``: tokenise texts into a token file (``NAME.bin``, ``NAME.idx``, ``NAME.json``).

    sppo-prepare data/corpus --output data/demo                        # byte ids 0..255, no eos (vocab 256)
    sppo-prepare a.txt b.txt --output out/ab --eos-id 256               # bytes plus eos 256 (vocab 257)
    sppo-prepare notes.txt --output out/notes --split blank-lines       # one document per paragraph
    sppo-prepare corpus/ --output out/corpus --tokenizer path/to/hf     # a local Hugging Face tokenizer
    sppo-prepare dump.jsonl --output out/dump --text-field content      # JSON lines, the text in "content"
    sppo-prepare shards/ --output out/web --tokenizer tok --workers 8   # *.parquet too (pyarrow), 8 processes
    sppo-prepare --verify out/web                                       # read every id again, record max_id

An INPUT is a file or a directory (``lightning_sppo.data.sources``): ``.txt`` files are one text each, ``.jsonl``
records and ``.parquet`` rows one text per record (``--text-field``, default ``text``), and a directory
contributes its ``*.txt``, ``*.jsonl`` and ``*.parquet`` files (recursively, in sorted order). Documents are
whole texts (``--split file``, default) or the blocks of text between blank lines (``--split blank-lines``);
empty and whitespace-only texts are skipped.

Documents reach the tokenizer in batches (``--batch-size``). With ``--workers N`` (N > 1), N processes encode
batches while this one reads and writes; results are written in input order, so the token file is byte for
byte the same for any N. A Hugging Face ``tokenizer.json`` tokenizer already spreads a batch over its own
threads in one process; workers run it on one thread each. The sidecar records the largest id
(``max_id``): training checks it instead of reading every id on every rank, and ``--verify`` reads them all.
A mistake in the arguments or the inputs (a missing file, an output path under a file, a line that is not
JSON, a tokenizer that cannot be loaded, an id outside the vocabulary) prints one ``sppo-prepare: error: ...``
line and exits with status 2, as every settings error of the package's commands; any other failure while
writing (a full disk) is one line with status 1, and a bug keeps its traceback.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from lightning_sppo.data.sources import ReadStats, input_files, read_documents
from lightning_sppo.data.token_file import TokenFile, token_file_paths, write_sidecar, write_tokens
from lightning_sppo.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from lightning_sppo.errors import OneLineParser

__all__ = ["build_parser", "main", "prepare", "verify"]

_PROG = "sppo-prepare"
_BATCH_CHARS = 2**24
"""A batch closes early once its texts hold this many characters (~16 MB): it bounds memory, not the work."""


_SETTINGS_ERRORS = (
    ValueError,
    ImportError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)
"""Errors the arguments or the inputs cause (exit status 2); any other ``OSError`` exits with 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=_PROG,
        description="Tokenise texts (.txt, .jsonl, .parquet) into a lightning-sppo token file (NAME.bin, NAME.idx,"
        " NAME.json), or --verify token files.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files (.txt), JSON lines (.jsonl), Parquet files (.parquet) or directories of them;"
        " with --verify, token files",
    )
    parser.add_argument("--output", "-o", metavar="OUT/NAME", help="token file to write (NAME.bin, .idx, .json)")
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|DIR",
        help="'bytes' (UTF-8 bytes, vocab 256; default) or a local Hugging Face tokenizer directory",
    )
    parser.add_argument(
        "--eos-id",
        type=_parse_eos_id,
        default=None,
        metavar="N|none",
        help="end-of-document id inserted between documents by the reader; default: none for bytes (256 adds"
        " one id: vocab 257), the tokenizer's eos token for Hugging Face tokenizers",
    )
    parser.add_argument(
        "--split",
        choices=("file", "blank-lines"),
        default="file",
        help="one document per text (a file, a JSON line, a Parquet row; default), or one per block of text"
        " between blank lines",
    )
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field of a .jsonl record, or the column of a .parquet file, that holds the text (default: text)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="processes that encode batches in parallel (default 1: this process); the output is the same for any N",
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, default=256, metavar="N", help="documents per encoding batch (default 256)"
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="replace the token file --output names if it exists (default: refuse, so no data set a run reads is"
        " replaced by accident)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read every id of the token files given as INPUTs, check them against the vocabulary and the recorded"
        " max_id, and record max_id where the sidecar lacks it",
    )
    return parser


def _parse_eos_id(value: str) -> int | Literal["none"]:
    if value.lower() == "none":
        return "none"
    try:
        eos_id = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'none', got {value!r}") from None
    if eos_id < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'none', got {value!r}")
    return eos_id


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


class _TokenizerSpec(NamedTuple):
    """What ``load_tokenizer`` needs: small and picklable, so every worker process loads its own tokenizer."""

    name: str
    eos_id: int | None
    use_default_eos: bool

    def load(self) -> ByteTokenizer | HFTokenizer:
        return load_tokenizer(self.name, self.eos_id, use_default_eos=self.use_default_eos)


def prepare(
    inputs: Sequence[str],
    output: str,
    tokenizer: str = "bytes",
    eos_id: int | Literal["none"] | None = None,
    split: Literal["file", "blank-lines"] = "file",
    text_field: str = "text",
    workers: int = 1,
    batch_size: int = 256,
) -> str:
    """Tokenise ``inputs`` into the token file ``output``; returns a one-line summary.

    ``workers`` > 1 encodes in that many processes; the file written is the same for any ``workers``.
    """
    if workers < 1 or batch_size < 1:
        raise ValueError(f"workers and batch_size must be >= 1, got workers={workers}, batch_size={batch_size}")
    files = input_files(inputs)
    spec = _TokenizerSpec(tokenizer, None if eos_id == "none" else eos_id, eos_id != "none")
    tok = spec.load()  # here too: vocab_size and eos_id for the sidecar, and errors before any worker starts
    stats = ReadStats()
    batches = _batches(read_documents(files, text_field, split, stats), batch_size)
    documents = _checked(_encoded(batches, spec, tok, workers), tok.eos_id, stats, files)
    meta = write_tokens(output, documents, tok.vocab_size, eos_id=tok.eos_id, tokenizer=tok.name)
    skipped = f", {stats.skipped} empty skipped" if stats.skipped else ""
    return (
        f"wrote {token_file_paths(output)[0]}: {meta.num_tokens} tokens in {meta.documents} documents"
        f" ({stats.files} files, {stats.texts} texts{skipped}); tokenizer={meta.tokenizer}"
        f" vocab_size={meta.vocab_size} dtype={meta.dtype} eos_id={meta.eos_id} max_id={meta.max_id}"
    )


class _Batch(NamedTuple):
    wheres: list[str]
    """Where each document comes from (file, line or row), for errors."""
    texts: list[str]


def _batches(documents: Iterable[tuple[str, str]], batch_size: int) -> Iterator[_Batch]:
    batch = _Batch([], [])
    chars = 0
    for where, text in documents:
        batch.wheres.append(where)
        batch.texts.append(text)
        chars += len(text)
        if len(batch.texts) >= batch_size or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = _Batch([], []), 0
    if batch.texts:
        yield batch


def _encoded(
    batches: Iterator[_Batch], spec: _TokenizerSpec, tokenizer: ByteTokenizer | HFTokenizer, workers: int
) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """``(wheres, ids)`` of each batch, in the order of ``batches``: encoded here, or in ``workers`` processes."""
    if workers == 1:
        for batch in batches:
            yield batch.wheres, tokenizer.encode_batch(batch.texts)
        return
    # Linux forks: a spawned worker would re-import torch and Lightning (seconds each) through the package.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context(method), _start_worker, (spec,))
    pending: deque[tuple[list[str], Future]] = deque()
    try:
        for batch in batches:
            pending.append((batch.wheres, pool.submit(_encode_in_worker, batch.texts)))
            if len(pending) >= 2 * workers:  # read ahead of the writer by two batches per worker, no more
                wheres, future = pending.popleft()
                yield wheres, future.result()
        while pending:
            wheres, future = pending.popleft()
            yield wheres, future.result()
    finally:
        pool.shutdown(cancel_futures=True)


_worker_tokenizer: ByteTokenizer | HFTokenizer | None = None


def _start_worker(spec: _TokenizerSpec) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = spec.load()


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _worker_tokenizer.encode_batch(texts)


def _checked(
    batches: Iterable[tuple[list[str], list[np.ndarray]]], eos_id: int | None, stats: ReadStats, files: list[Path]
) -> Iterator[np.ndarray]:
    """The documents' ids; an eos id inside a document (it would split it) is an error naming where, and inputs
    without any text an error naming them."""
    index = 0
    for wheres, batch in batches:
        for where, ids in zip(wheres, batch, strict=True):
            if eos_id is not None and ids.size and (ids == eos_id).any():
                position = int(np.flatnonzero(ids == eos_id)[0])
                raise ValueError(
                    f"{where} contains the eos id {eos_id} (document {index}, token {position}), which would split"
                    " it; pick another --eos-id (256 for bytes) or --eos-id none"
                )
            index += 1
            yield ids
    if not index:  # raised inside the stream, so write_tokens leaves any previous output alone
        raise ValueError(f"{_named(files)} no text: nothing to write; give files that hold text")


def _named(files: list[Path], most: int = 3) -> str:
    """``a.txt holds``, ``a.txt and b.txt hold``, ``the 12 input files (a.txt, b.txt, c.txt, ...) hold``."""
    names = [str(f) for f in files]
    if len(names) == 1:
        return f"INPUT {names[0]} holds"
    if len(names) <= most:
        return f"INPUT {', '.join(names[:-1])} and {names[-1]} hold"
    return f"the {len(names)} INPUT files ({', '.join(names[:most])}, ...) hold"


def verify(paths: Sequence[str]) -> str:
    """Read every id of each token file (``TokenFile.verify``); record ``max_id`` in sidecars that lack it."""
    lines = []
    for path in paths:
        token_file = TokenFile.open(path, check_ids=False)
        largest = token_file.verify()
        recorded = token_file.meta.max_id is not None or largest is None
        if not recorded:
            write_sidecar(path, replace(token_file.meta, max_id=largest))
        lines.append(
            f"verified {token_file.bin_path}: {token_file.num_tokens} ids in [0, {token_file.vocab_size}),"
            f" max_id={largest}" + ("" if recorded else " (now recorded in the sidecar)")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sppo-prepare``; returns the exit status (0; 2 after a one-line settings error, 1 after
    another one-line failure)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, exit status 2
    if args.verify == (args.output is not None):
        parser.error("give --output OUT/NAME to prepare a token file, or --verify (and no --output) to check them")
    if args.output is not None and (problem := _output_problem(args.output, args.replace)) is not None:
        print(f"{_PROG}: error: --output={args.output!r}{problem}", file=sys.stderr)
        return 2
    try:
        if args.verify:
            summary = verify(args.inputs)
        else:
            summary = prepare(
                args.inputs, args.output, args.tokenizer, args.eos_id, args.split, args.text_field, args.workers,
                args.batch_size,
            )  # fmt: skip
    except (OSError, ValueError, ImportError) as err:
        message = " ".join(str(err).split())
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return 2 if isinstance(err, _SETTINGS_ERRORS) else 1
    print(summary)
    return 0


def _output_problem(output: str, replace_existing: bool) -> str | None:
    """What stops ``--output`` from naming a new token file (the rest of the error line), or None."""
    if not Path(output).name or output.endswith(("/", os.sep)):
        return f" names a folder; give the token file's path and name in it, e.g. --output {os.path.join(output, 'tokens')}"
    if (blocked := _file_above(output)) is not None:
        return f": {blocked!r} is a file, not a folder"
    existing = [str(part) for part in token_file_paths(output) if part.exists()]
    if existing and not replace_existing:
        return f": {existing[0]!r} exists; pass --replace to replace that token file, or name another --output"
    return None


def _file_above(output: str) -> str | None:
    """The first existing path above ``output`` (its folders) that is a file, if any: the token file's parts go
    there (``NAME.bin`` beside ``NAME.json``), so each of them must be a folder."""
    for parent in Path(output).parents:
        if parent.exists():
            return None if parent.is_dir() else str(parent)
    return None


if __name__ == "__main__":
    sys.exit(main())
