"""Data: pre-tokenised token files (``sppo-prepare``), fixed-length samples, and a LightningDataModule.

sppo-prepare data/corpus --output data/demo          # text files -> data/demo.{bin,idx,json}

from lightning_sppo.data import PackedSequences, TokenFile
dataset = PackedSequences(TokenFile.open("data/demo"), seq_len=512)   # dicts of input_ids, targets
"""

from typing import Any

from lightning_sppo.data.dataset import PackedSequences
from lightning_sppo.data.token_file import TokenFile, TokenFileMeta, write_tokens
from lightning_sppo.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PackedSequences",
    "TokenDataModule",
    "TokenFile",
    "TokenFileMeta",
    "load_tokenizer",
    "write_tokens",
]


def __getattr__(name: str) -> Any:
    # TokenDataModule imports lightning.pytorch (over a second); sppo-prepare and Fabric users never need it.
    if name == "TokenDataModule":
        from lightning_sppo.data.datamodule import TokenDataModule

        return TokenDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
