"""``sppo-prepare``: tokenise text files into a token file (``NAME.bin``, ``NAME.idx``, ``NAME.json``).

    sppo-prepare data/corpus --output data/demo                      # byte ids 0..255, no eos (vocab 256)
    sppo-prepare a.txt b.txt --output out/ab --eos-id 256             # bytes plus eos 256 (vocab 257)
    sppo-prepare notes.txt --output out/notes --split blank-lines     # one document per paragraph
    sppo-prepare corpus/ --output out/corpus --tokenizer path/to/hf   # a local Hugging Face tokenizer

An INPUT is a UTF-8 text file or a directory, which contributes its ``*.txt`` files (recursively, in
sorted order). Documents are whole files (``--split file``, default) or the blocks of text between
blank lines (``--split blank-lines``); empty and whitespace-only files and blocks are skipped. Errors print one line on stderr
and exit with status 1.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from lightning_sppo.data.token_file import token_file_paths, write_tokens
from lightning_sppo.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["build_parser", "main", "prepare"]

_PROG = "sppo-prepare"
_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # a line break, then one or more blank lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Tokenise text files into a lightning-sppo token file (NAME.bin, NAME.idx, NAME.json).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="UTF-8 text files, or directories of *.txt files")
    parser.add_argument(
        "--output", "-o", required=True, metavar="OUT/NAME", help="token file to write (NAME.bin, .idx, .json)"
    )
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
        help="one document per file (default), or one per block of text between blank lines",
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


def _input_files(inputs: Sequence[str]) -> list[Path]:
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise FileNotFoundError(f"input directory {item!r} has no *.txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {item!r} not found")
    return files


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err.reason} at byte {err.start}") from None


def _documents(
    files: Sequence[Path], tokenizer: ByteTokenizer | HFTokenizer, split: str, stats: dict[str, int]
) -> Iterator[np.ndarray]:
    for path in files:
        text = _read_text(path)
        if not text.strip():
            stats["skipped"] += 1  # an empty or whitespace-only file
            continue
        if split == "blank-lines":
            pieces = [piece.strip("\n") for piece in _BLANK_LINES.split(text) if piece.strip()]
        else:
            pieces = [text]
        for piece in pieces:
            ids = tokenizer.encode(piece)
            if tokenizer.eos_id is not None and ids.size and (ids == tokenizer.eos_id).any():
                position = int(np.flatnonzero(ids == tokenizer.eos_id)[0])
                raise ValueError(
                    f"{path} contains the eos id {tokenizer.eos_id} (document {stats['documents']}, token {position}),"
                    " which would split it; pick another --eos-id (256 for bytes) or --eos-id none"
                )
            stats["tokens"] += ids.size
            stats["documents"] += 1
            yield ids
    if not stats["tokens"]:  # raised inside the stream, so write_tokens leaves any previous output alone
        raise ValueError(f"the inputs ({len(files)} files) hold no text: nothing to write")


def prepare(
    inputs: Sequence[str],
    output: str,
    tokenizer: str = "bytes",
    eos_id: int | Literal["none"] | None = None,
    split: Literal["file", "blank-lines"] = "file",
) -> str:
    """Tokenise ``inputs`` into the token file ``output``; returns a one-line summary."""
    files = _input_files(inputs)
    tok = load_tokenizer(tokenizer, None if eos_id == "none" else eos_id, use_default_eos=eos_id != "none")
    stats = {"skipped": 0, "tokens": 0, "documents": 0}
    meta = write_tokens(
        output, _documents(files, tok, split, stats), tok.vocab_size, eos_id=tok.eos_id, tokenizer=tok.name
    )
    skipped = f", {stats['skipped']} empty skipped" if stats["skipped"] else ""  # files
    return (
        f"wrote {token_file_paths(output)[0]}: {meta.num_tokens} tokens in {meta.documents} documents"
        f" ({len(files)} files{skipped}); tokenizer={meta.tokenizer} vocab_size={meta.vocab_size}"
        f" dtype={meta.dtype} eos_id={meta.eos_id}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sppo-prepare``; returns the exit status (0, or 1 after a one-line error)."""
    args = build_parser().parse_args(argv)  # usage errors: argparse prints usage and exits with 2
    try:
        summary = prepare(args.inputs, args.output, args.tokenizer, args.eos_id, args.split)
    except (OSError, ValueError, ImportError) as err:
        message = " ".join(str(err).split())
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
