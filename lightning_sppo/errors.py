"""The package's own exception types, and the boundary where its checks become them.

A check of ours that refuses a setting raises ``SPPOConfigError`` (or a ``ValueError`` naming the setting, the
value, the constraint and a valid value, which ``config_errors`` turns into one at the public entry points:
the strategies' constructors, set-up and steps). The ``sppo`` command prints those as one line; every other
exception (a bug, a broken environment) keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["NonFiniteError", "SPPOConfigError", "config_errors"]

_PACKAGE = Path(__file__).resolve().parent


class SPPOConfigError(ValueError):
    """A setting that cannot work; the message names the setting, the value, the constraint and a valid value."""


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of a step is not finite: training diverged (the step was not applied)."""


@contextmanager
def config_errors() -> Iterator[None]:
    """Re-raise the ``ValueError``s of our own checks inside the block as ``SPPOConfigError``.

    Only errors raised by this package's code count (the innermost frame of the traceback lies in it): a
    ``ValueError`` from torch or Lightning is left alone, as is any other exception type.
    """
    try:
        yield
    except SPPOConfigError:
        raise
    except ValueError as error:
        if not _raised_by_package(error):
            raise
        raise SPPOConfigError(str(error)) from error


def _raised_by_package(error: BaseException) -> bool:
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return _PACKAGE in Path(frame.tb_frame.f_code.co_filename).resolve().parents
