"""Token counts and byte sizes as people write them: ``1M``, ``512K``, ``1.28M``; ``61.3 GiB``."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "format_tokens", "parse_bytes", "parse_tokens"]

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_TOKENS = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)(?P<suffix>[KMG]?)")


def parse_tokens(text: str, flag: str = "--seq-len") -> int:
    """``1048576``, ``512K``, ``1M``, ``1.28M`` -> tokens. K, M, G are binary (1M = 1024K = 1048576), as in the
    paper's tables (1024K); a fractional count rounds to the nearest token (1.28M = 1342177)."""
    match = _TOKENS.fullmatch(text.strip().upper().replace("_", ""))
    if match is None:
        raise ValueError(f"{flag}={text!r} is not a token count; use e.g. 512K, 1M, 1.28M or 1048576.")
    value = float(match["number"]) * _SUFFIX[match["suffix"]]
    tokens = round(value)
    if tokens < 1 or not math.isfinite(value):
        raise ValueError(f"{flag}={text!r} must be at least one token.")
    return tokens


_BYTES = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<suffix>[KMGT]?)(?:I?B)?")
_BYTE_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """``2T``, ``1.5TiB``, ``512G``, ``2199023255552`` -> bytes; the units are binary (1T = 1024G)."""
    match = _BYTES.fullmatch(text.strip().upper().replace("_", ""))
    if match is None:
        raise ValueError(f"{flag}={text!r} is not a size; use e.g. 2T, 1.5T, 512G or a number of bytes.")
    value = round(float(match["number"]) * _BYTE_SUFFIX[match["suffix"]])
    if value < 1:
        raise ValueError(f"{flag}={text!r} must be at least one byte.")
    return value


def format_tokens(tokens: int) -> str:
    """1048576 -> ``1M``, 524288 -> ``512K``, anything else (0 too) as digits."""
    for suffix in ("M", "K"):
        if tokens and tokens % _SUFFIX[suffix] == 0:
            return f"{tokens // _SUFFIX[suffix]}{suffix}"
    return str(tokens)


def format_bytes(nbytes: float) -> str:
    """Binary units: ``61.3 GiB``, ``512.0 MiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"
