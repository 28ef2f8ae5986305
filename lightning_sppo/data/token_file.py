"""Pre-tokenised corpora on disk: a memory-mapped id file, a document index and a JSON sidecar.

A token file ``NAME`` is three files side by side:

- ``NAME.bin``: every document's token ids back to back, little-endian ``uint16`` when the vocabulary
  fits (``vocab_size <= 65536``), else ``uint32``. No separators are stored: the eos token, if any,
  is inserted by the reader (``PackedSequences``), so one file serves packed and unpacked training.
- ``NAME.idx``: ``documents + 1`` little-endian ``uint64`` offsets into ``NAME.bin`` (in tokens);
  document ``i`` is ``ids[offsets[i]:offsets[i + 1]]``, ``offsets[0] == 0``, ``offsets[-1] == num_tokens``.
- ``NAME.json``: the sidecar, ``TokenFileMeta`` as JSON (format, version, dtype, vocab_size,
  num_tokens, documents, max_id, eos_id, tokenizer, byte_order).

``write_tokens`` writes all three (to temporary names first, so a failed write leaves no half file), checking
every id against the vocabulary as it goes and recording the largest one (``max_id``). ``TokenFile.open``
reads the sidecar, checks it against the sizes of the other two files and ``max_id`` against the vocabulary,
and memory-maps the ids: opening never reads the ids, so every rank of a run can open a large file at start-up.
``TokenFile.verify`` reads them all (``sppo-prepare --verify NAME``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = [
    "FORMAT",
    "TOKEN_FILE_SUFFIXES",
    "VERSION",
    "TokenFile",
    "TokenFileMeta",
    "dtype_for_vocab",
    "token_file_paths",
    "write_sidecar",
    "write_tokens",
]

FORMAT = "lightning-sppo-tokens"
VERSION = 1
TOKEN_FILE_SUFFIXES = (".bin", ".idx", ".json")
"""The parts of a token file ``NAME``: ``NAME.bin`` (the ids), ``NAME.idx`` (document offsets), ``NAME.json``."""
_OFFSET_DTYPE = np.dtype("<u8")
_CHECK_CHUNK = 2**24  # ids per chunk of the vocabulary check: 32-64 MiB read at a time


def dtype_for_vocab(vocab_size: int) -> Literal["uint16", "uint32"]:
    """The narrowest id dtype that holds every id of a ``vocab_size`` vocabulary."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be an integer in [1, 2**32], got vocab_size={vocab_size!r}.")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype("<u2" if name == "uint16" else "<u4")  # always little-endian on disk


def token_file_paths(path: str | os.PathLike) -> tuple[Path, Path, Path]:
    """``(NAME.bin, NAME.idx, NAME.json)`` for ``NAME`` given with or without one of those suffixes."""
    path = Path(path)
    if path.suffix in TOKEN_FILE_SUFFIXES:
        path = path.with_suffix("")
    return path.with_name(path.name + ".bin"), path.with_name(path.name + ".idx"), path.with_name(path.name + ".json")


@dataclass(frozen=True, kw_only=True)
class TokenFileMeta:
    """The JSON sidecar of a token file."""

    format: str = FORMAT
    """Always ``"lightning-sppo-tokens"``."""
    version: int = VERSION
    """Format version; readers refuse versions they do not know."""
    vocab_size: int
    """Number of token ids; every stored id is < vocab_size."""
    num_tokens: int
    """Ids in ``NAME.bin`` (all documents, no separators)."""
    documents: int
    """Number of documents; ``NAME.idx`` holds ``documents + 1`` offsets."""
    max_id: int | None = None
    """The largest id in ``NAME.bin``, found by ``write_tokens`` while it checked every id (``None`` when the file
    has no tokens). Sidecars written before it was recorded lack it: ``TokenFile.open`` then reads every id."""
    dtype: Literal["uint16", "uint32"]
    """Id dtype in ``NAME.bin``: ``uint16`` when vocab_size <= 65536, else ``uint32``."""
    eos_id: int | None
    """End-of-document id the reader inserts between documents, or ``None`` (documents are not separated)."""
    tokenizer: str
    """What made the ids: ``"bytes"`` (UTF-8 bytes) or ``"huggingface:<dir>"``; informational."""
    byte_order: Literal["little"] = "little"
    """Byte order of ``NAME.bin`` and ``NAME.idx``."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "sidecar") -> TokenFileMeta:
        """Parse and check a sidecar; errors name the file, the field and the value."""
        if raw.get("format") != FORMAT:
            raise ValueError(
                f"{source} is not a lightning-sppo token file: format={raw.get('format')!r}, expected {FORMAT!r}."
            )
        if raw.get("version") != VERSION:
            raise ValueError(
                f"{source} has version={raw.get('version')!r}; this lightning-sppo reads version {VERSION}."
            )
        missing = sorted({"vocab_size", "num_tokens", "documents", "dtype", "eos_id", "tokenizer"} - raw.keys())
        if missing:
            raise ValueError(f"{source} lacks the field(s) {missing}; re-run sppo-prepare.")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        meta = cls(**known)
        meta._check(source)
        return meta

    def _check(self, source: str) -> None:
        expected = dtype_for_vocab(self.vocab_size)
        if self.dtype != expected:
            raise ValueError(f"{source} has dtype={self.dtype!r}, but vocab_size={self.vocab_size} needs {expected!r}.")
        for key in ("num_tokens", "documents"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{source} has {key}={value!r}; expected a non-negative integer.")
        if self.max_id is not None and not (isinstance(self.max_id, int) and self.max_id >= 0 and self.num_tokens):
            raise ValueError(
                f"{source} has max_id={self.max_id!r} with num_tokens={self.num_tokens}; expected null for a file"
                " without tokens, else a non-negative integer. Re-run sppo-prepare."
            )
        if self.eos_id is not None and not (isinstance(self.eos_id, int) and 0 <= self.eos_id < self.vocab_size):
            raise ValueError(f"{source} has eos_id={self.eos_id!r}; expected null or an id in [0, {self.vocab_size}).")
        if self.byte_order != "little":
            raise ValueError(f"{source} has byte_order={self.byte_order!r}; only 'little' is written or read.")


def write_tokens(
    path: str | os.PathLike,
    documents: Iterable[Sequence[int] | np.ndarray],
    vocab_size: int,
    *,
    eos_id: int | None = None,
    tokenizer: str = "unknown",
) -> TokenFileMeta:
    """Write ``documents`` (each a sequence of ids) as the token file ``path`` (``NAME`` or ``NAME.bin``).

    Streams: one document is in memory at a time (plus one offset per document). Every id must lie in
    ``[0, vocab_size)``; a ValueError names the first one that does not, with its document and position.
    The largest id is recorded in the sidecar (``max_id``), so readers need not scan the ids again.
    Empty documents are kept (they have no tokens but count as documents). Returns the sidecar.
    """
    dtype = dtype_for_vocab(vocab_size)
    meta_check = TokenFileMeta(
        vocab_size=vocab_size, num_tokens=0, documents=0, dtype=dtype, eos_id=eos_id, tokenizer=tokenizer
    )
    meta_check._check("write_tokens")
    bin_path, idx_path, json_path = token_file_paths(path)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    temporaries = [p.with_name(p.name + ".tmp") for p in (bin_path, idx_path, json_path)]
    offsets = [0]
    max_id: int | None = None
    try:
        with open(temporaries[0], "wb") as out:
            for doc_index, doc in enumerate(documents):
                ids = np.asarray(doc)
                if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                    raise ValueError(
                        f"Document {doc_index} must be a 1-d sequence of integer ids, got dtype={ids.dtype}, shape={ids.shape}."
                    )
                largest = _check_ids(ids, vocab_size, f"document {doc_index}")
                if largest is not None:
                    max_id = largest if max_id is None else max(max_id, largest)
                ids.astype(_numpy_dtype(dtype)).tofile(out)
                offsets.append(offsets[-1] + ids.size)
        np.asarray(offsets, dtype=_OFFSET_DTYPE).tofile(temporaries[1])
        meta = TokenFileMeta(
            vocab_size=vocab_size,
            num_tokens=offsets[-1],
            documents=len(offsets) - 1,
            max_id=max_id,
            dtype=dtype,
            eos_id=eos_id,
            tokenizer=tokenizer,
        )
        temporaries[2].write_text(meta.to_json())
        # Renamed only once all three are complete, sidecar last: a failed write keeps any previous file whole.
        for tmp, final in zip(temporaries, (bin_path, idx_path, json_path), strict=True):
            os.replace(tmp, final)
    finally:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
    return meta


def write_sidecar(path: str | os.PathLike, meta: TokenFileMeta) -> None:
    """Replace the sidecar of the token file ``path`` with ``meta`` (atomically: a temporary file, then a rename)."""
    json_path = token_file_paths(path)[2]
    tmp = json_path.with_name(json_path.name + ".tmp")
    try:
        tmp.write_text(meta.to_json())
        os.replace(tmp, json_path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_ids(ids: np.ndarray, vocab_size: int, where: str, start: int = 0) -> int | None:
    """The largest id of ``ids`` (None if empty); a ValueError names the first id outside ``[0, vocab_size)``."""
    if not ids.size:
        return None
    largest = int(ids.max())
    if ids.min() >= 0 and largest < vocab_size:  # the common case: two passes, no index array
        return largest
    bad = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
    raise ValueError(
        f"Token id {int(ids[bad])} at position {start + bad} of {where} is outside the vocabulary"
        f" [0, {vocab_size}); vocab_size={vocab_size}."
    )


class TokenFile:
    """A token file opened for reading: the sidecar, the document offsets and the memory-mapped ids.

    Build with ``TokenFile.open(path)``. ``ids`` is a read-only ``np.memmap``; ``document(i)`` is a
    view of one document. Pickling keeps only the paths and the sidecar, and the copy maps the file
    again, so DataLoader workers never copy the ids.
    """

    def __init__(self, path: Path, meta: TokenFileMeta, offsets: np.ndarray) -> None:
        self.path = path
        """``NAME``, the token file's path without suffix."""
        self.meta = meta
        self.offsets = offsets
        self._ids: np.memmap | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, check_ids: bool = True) -> TokenFile:
        """Open and validate the token file ``path`` (``NAME``, or ``NAME.bin``/``.idx``/``.json``).

        Raises FileNotFoundError if a part is missing, ValueError if the parts disagree or, with
        ``check_ids`` (default), if the sidecar's ``max_id`` is outside the vocabulary. That check reads no
        id: ``write_tokens`` checked every id and recorded the largest. A sidecar without ``max_id`` (written
        before it was recorded) gets a full read instead, with a warning; ``sppo-prepare --verify NAME``
        records it. ``verify()`` reads every id whatever the sidecar says.
        """
        bin_path, idx_path, json_path = token_file_paths(path)
        for part in (json_path, bin_path, idx_path):
            if not part.is_file():
                raise FileNotFoundError(
                    f"Token file part {str(part)!r} not found; create the token file with"
                    f" `sppo-prepare TEXT_FILES... --output {bin_path.with_suffix('')}`."
                )
        try:
            raw = json.loads(json_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{json_path} is not valid JSON ({err}); re-run sppo-prepare.") from err
        if not isinstance(raw, dict):
            raise ValueError(f"{json_path} must hold a JSON object, got {type(raw).__name__}.")
        meta = TokenFileMeta.from_dict(raw, source=str(json_path))

        itemsize = _numpy_dtype(meta.dtype).itemsize
        if bin_path.stat().st_size != meta.num_tokens * itemsize:
            raise ValueError(
                f"{bin_path} has {bin_path.stat().st_size} bytes, but the sidecar says num_tokens={meta.num_tokens}"
                f" of {meta.dtype} ({meta.num_tokens * itemsize} bytes); the file is truncated or stale."
            )
        offsets = np.fromfile(idx_path, dtype=_OFFSET_DTYPE).astype(np.int64)
        if (
            offsets.size != meta.documents + 1
            or offsets[0] != 0
            or offsets[-1] != meta.num_tokens
            or (np.diff(offsets) < 0).any()
        ):
            raise ValueError(
                f"{idx_path} does not match the sidecar (documents={meta.documents}, num_tokens={meta.num_tokens}):"
                f" expected {meta.documents + 1} non-decreasing offsets from 0 to {meta.num_tokens}."
            )
        token_file = cls(bin_path.with_suffix(""), meta, offsets)  # bin_path ends in ".bin"
        if check_ids:
            token_file.check_ids()
        return token_file

    @property
    def ids(self) -> np.ndarray:
        """All ids, memory-mapped read-only (``num_tokens`` of ``meta.dtype``)."""
        if self._ids is None:
            if self.meta.num_tokens == 0:  # np.memmap refuses empty files
                self._ids = np.empty(0, dtype=_numpy_dtype(self.meta.dtype))
            else:
                self._ids = np.memmap(self.bin_path, dtype=_numpy_dtype(self.meta.dtype), mode="r")
        return self._ids

    @property
    def bin_path(self) -> Path:
        return token_file_paths(self.path)[0]

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def eos_id(self) -> int | None:
        return self.meta.eos_id

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def num_documents(self) -> int:
        return self.meta.documents

    def document(self, index: int) -> np.ndarray:
        """The ids of document ``index`` (a view into the memory map)."""
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"Document index {index} out of range for {self.num_documents} documents.")
        index %= self.num_documents
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    def check_ids(self) -> None:
        """Check the recorded ``max_id`` against the vocabulary, without reading the ids.

        Raises a ValueError when ``max_id >= vocab_size``. Without a recorded ``max_id`` (an older sidecar), reads
        every id once (``verify``) and warns that ``sppo-prepare --verify`` would record it.
        """
        meta = self.meta
        if meta.max_id is not None:
            if meta.max_id >= meta.vocab_size:
                raise ValueError(
                    f"{self.path}.json records max_id={meta.max_id}, outside the vocabulary [0, {meta.vocab_size});"
                    f" vocab_size={meta.vocab_size}. Re-run sppo-prepare with the tokenizer that made the ids."
                )
            return
        if meta.num_tokens:
            warnings.warn(
                f"{self.path}.json does not record max_id, so every id is read to check it; record it once with"
                f" `sppo-prepare --verify {self.path}`.",
                stacklevel=3,
            )
            self.verify()

    def verify(self) -> int | None:
        """Read every id: raise a ValueError naming the first one outside ``[0, vocab_size)`` and its position,
        or a recorded ``max_id`` the ids disagree with. Returns the largest id (None for a file without tokens).

        About a second per GB, in chunks; ``check_ids`` (what ``open`` does) trusts the recorded ``max_id`` instead.
        """
        ids, largest = self.ids, None
        for start in range(0, ids.size, _CHECK_CHUNK):
            chunk_max = _check_ids(ids[start : start + _CHECK_CHUNK], self.vocab_size, str(self.bin_path), start)
            largest = chunk_max if largest is None else max(largest, chunk_max)
        recorded = self.meta.max_id
        if recorded is not None and recorded != largest:
            raise ValueError(
                f"{self.path}.json records max_id={recorded}, but the largest id in {self.bin_path} is {largest}:"
                " the ids changed after sppo-prepare wrote them. Re-run sppo-prepare."
            )
        return largest

    def __len__(self) -> int:
        return self.num_documents

    def __repr__(self) -> str:
        m = self.meta
        return (
            f"TokenFile({str(self.path)!r}, num_tokens={m.num_tokens}, documents={m.documents}, vocab_size={m.vocab_size},"
            f" dtype={m.dtype}, eos_id={m.eos_id}, tokenizer={m.tokenizer!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "meta": self.meta, "offsets": self.offsets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["meta"], state["offsets"])
