"""Tokenizers for ``sppo-prepare``: the built-in byte tokenizer, or a local Hugging Face tokenizer.

Both turn text into a 1-d array of ids (``encode``, or ``encode_batch`` for a list of texts) and report
``vocab_size``, ``eos_id`` and a ``name`` for the token file's sidecar. Hugging Face libraries are imported
only when such a tokenizer is asked for: ``pip install "lightning-sppo[tokenizers]"`` for a directory with
``tokenizer.json``, ``pip install "lightning-sppo[transformers]"`` for any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = ["BYTE_VOCAB_SIZE", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]

BYTE_VOCAB_SIZE = 256


class ByteTokenizer:
    """Ids are the UTF-8 bytes of the text: vocabulary 256, no eos by default.

    ``eos_id`` is opt-in so that the default ids fit the tiny models (``vocab_size=256``):
    ``eos_id=256`` adds one id (vocabulary 257); an id below 256 reuses that byte value (0, the NUL
    byte, never occurs in text) and keeps the vocabulary at 256.
    """

    name = "bytes"

    def __init__(self, eos_id: int | None = None) -> None:
        if eos_id is not None and not 0 <= eos_id <= BYTE_VOCAB_SIZE:
            raise ValueError(
                f"The byte tokenizer takes --eos-id in [0, {BYTE_VOCAB_SIZE}], got --eos-id={eos_id}; try 256"
                " (vocabulary 257) or 0 (the NUL byte, vocabulary 256)."
            )
        self.eos_id = eos_id
        self.vocab_size = BYTE_VOCAB_SIZE + (eos_id == BYTE_VOCAB_SIZE)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < BYTE_VOCAB_SIZE).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer saved in a local directory.

    A directory with ``tokenizer.json`` loads with the ``tokenizers`` package; any other directory
    with ``transformers.AutoTokenizer`` (``local_files_only``: nothing is downloaded). Text is encoded
    without special tokens (no BOS); ``eos_id`` defaults to the tokenizer's own eos token, if it has one.
    """

    def __init__(self, directory: str | Path, eos_id: int | None = None, *, use_default_eos: bool = True) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(
                f"Tokenizer directory {str(directory)!r} not found; pass --tokenizer bytes or the path of a"
                " local Hugging Face tokenizer directory (one with tokenizer.json)."
            )
        self.name = f"huggingface:{directory.resolve()}"
        load = _load_tokenizers if (directory / "tokenizer.json").is_file() else _load_transformers
        try:
            self._encode_batch, self.vocab_size, default_eos = load(directory)
        except ImportError:
            raise
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            reason = " ".join(str(error).split()) or type(error).__name__
            if "trust_remote_code" in reason:  # transformers' advice to pass it: we never run a folder's code
                reason = "its tokenizer_config.json names Python code of its own (auto_map), which is never run"
            raise ValueError(
                f"--tokenizer={str(directory)!r} cannot be loaded as a Hugging Face tokenizer ({reason}); pass a"
                " local tokenizer directory holding a valid tokenizer.json, or --tokenizer bytes."
            ) from error
        self.eos_id = eos_id if eos_id is not None or not use_default_eos else default_eos
        if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos_id={self.eos_id} is outside the vocabulary of {directory} (vocab_size={self.vocab_size})."
            )

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text (uint32: every vocabulary fits). A ``tokenizers`` tokenizer spreads a batch over its
        own threads unless ``TOKENIZERS_PARALLELISM=false``."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self._encode_batch(list(texts))]


_BatchEncoder = Callable[[list[str]], list[list[int]]]


def _load_tokenizers(directory: Path) -> tuple[_BatchEncoder, int, int | None]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            f"Loading the tokenizer in {directory} needs the `tokenizers` package: pip install tokenizers"
            ' (or pip install "lightning-sppo[tokenizers]")'
        ) from None
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos_token = _configured_eos_token(directory)
    default_eos = None if eos_token is None else tokenizer.token_to_id(eos_token)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode_batch, tokenizer.get_vocab_size(with_added_tokens=True), default_eos


def _load_transformers(directory: Path) -> tuple[_BatchEncoder, int, int | None]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            f"{directory} has no tokenizer.json; loading it needs the `transformers` package: pip install transformers"
            ' (or pip install "lightning-sppo[transformers]")'
        ) from None
    # trust_remote_code=False: a folder whose tokenizer_config.json names its own Python class (``auto_map``) is
    # refused; left unset, transformers asks on the terminal whether to run that code.
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return encode_batch, len(tokenizer), tokenizer.eos_token_id


def _configured_eos_token(directory: Path) -> str | None:
    """The eos token named in ``tokenizer_config.json`` or ``special_tokens_map.json``, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config_path = directory / name
        if not config_path.is_file():
            continue
        try:
            eos = json.loads(config_path.read_text()).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue
        if isinstance(eos, dict):  # {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def load_tokenizer(
    spec: str, eos_id: int | None = None, *, use_default_eos: bool = True
) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` for the byte tokenizer, else the path of a local Hugging Face tokenizer directory.

    ``eos_id`` overrides the tokenizer's eos; ``use_default_eos=False`` with ``eos_id=None`` means no eos.
    """
    if spec == "bytes":
        return ByteTokenizer(eos_id)
    return HFTokenizer(spec, eos_id, use_default_eos=use_default_eos)
