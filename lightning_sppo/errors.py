"""The package's own exception types, and the boundary where its checks become them.

A check of ours that refuses a setting raises ``SPPOConfigError`` (or a ``ValueError`` naming the setting, the
value, the constraint and a valid value, which ``config_errors`` turns into one at the public entry points:
the strategies' constructors, set-up and steps), or a ``ValueError`` subclass of its own module (e.g. a
checkpoint of another model). The ``sppo`` command prints those as one line; every other exception (a bug, a
broken environment) keeps its traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

__all__ = [
    "NonFiniteError",
    "OneLineParser",
    "PeerFailedError",
    "SPPOConfigError",
    "config_errors",
    "error_chain",
    "is_settings_error",
]

_PACKAGE = Path(__file__).resolve().parent


class SPPOConfigError(ValueError):
    """A setting that cannot work; the message names the setting, the value, the constraint and a valid value."""


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of a step is not finite: training diverged (the step was not applied)."""


class PeerFailedError(RuntimeError):
    """Another rank failed at a step every rank takes together and told this one so: its own error is the one to
    report (the command waits for that rank's report and exits with its status instead of reporting this)."""


@contextmanager
def config_errors() -> Iterator[None]:
    """Re-raise the plain ``ValueError``s of our own checks inside the block as ``SPPOConfigError``.

    Only errors raised by this package's code count (the innermost frame of the traceback lies in it): a
    ``ValueError`` from torch or Lightning is left alone, as is any other exception type, and so are our own
    ``ValueError`` subclasses (already typed: callers catch them by their type).
    """
    try:
        yield
    except ValueError as error:
        if type(error) is not ValueError or not _raised_by_package(error):
            raise
        raise SPPOConfigError(str(error)) from error


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what caused it, outermost first (``__cause__``, else ``__context__``; a cycle ends it): the
    frameworks between a check and the command wrap our errors in their own."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def is_settings_error(error: BaseException) -> bool:
    """Whether ``error`` is one a user fixes in the settings: ``SPPOConfigError`` or another ``ValueError``
    subclass this package defines for its checks."""
    return isinstance(error, ValueError) and type(error).__module__.split(".")[0] == __name__.split(".")[0]


def _raised_by_package(error: BaseException) -> bool:
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return _PACKAGE in Path(frame.tb_frame.f_code.co_filename).resolve().parents


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``PROG: error: ...`` (with a pointer to ``--help``),
    and exit status 2, as every settings error of the package's commands."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
