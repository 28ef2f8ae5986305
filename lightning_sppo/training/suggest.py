""" "Did you mean ...?" for an option or config key the ``sppo`` command does not know.

jsonargparse names the unknown option in one of three ways, and each is matched here to the known names of its
namespace (``difflib``, the closest one only):

* ``unrecognized arguments: --model.learning_rat 1e-3`` (command line): ``--model.learning_rate``;
* ``Subcommand 'fit' does not accept option 'model.learning_rat'`` or ``Group 'model' does not accept option
  'learning_rat'`` (a key of a config file): ``model.learning_rate``;
* ``Option 'modle.model' is not accepted`` (a misspelt top-level key): ``model.model``; under
  ``Parser key "trainer.strategy"`` the settings of ``SPPOTrainerStrategy``:
  ``trainer.strategy.init_args.pipeline_parallel``.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable

__all__ = ["close_match", "known_options", "suggestion"]

_CUTOFF = 0.6  # difflib's default: "learning_rat" -> "learning_rate" (0.96), unrelated words stay below
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_GROUP = re.compile(r"(Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)'")
_OPTION = re.compile(r"Option '([\w.]+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')


def known_options(parsers: Iterable, strategy: type | None = None) -> list[str]:
    """The dotted names (``model.learning_rate``) that ``parsers`` (jsonargparse) accept as ``--name``, and
    ``trainer.strategy.init_args.<name>`` for each keyword of ``strategy``'s constructor."""
    names: set[str] = set()
    for parser in parsers:
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and not option.endswith((".help", "+")):
                    names.add(option[2:])
    if strategy is not None:
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        parameters = inspect.signature(strategy).parameters.values()
        names |= {f"trainer.strategy.init_args.{p.name}" for p in parameters if p.kind in named}
    return sorted(names)


def close_match(name: str, known: Iterable[str]) -> str | None:
    """The known dotted name closest to ``name``: the closest leaf in the same namespace when that namespace
    exists (``model.learning_rat`` -> ``model.learning_rate``), else the closest whole name (a misspelt
    namespace: ``modle.model`` -> ``model.model``); None when nothing is close."""
    known = list(known)
    namespace, _, leaf = name.rpartition(".")
    leaves = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == namespace]
    if namespace and leaves:
        match = difflib.get_close_matches(leaf, leaves, n=1, cutoff=_CUTOFF)
        return f"{namespace}.{match[0]}" if match else None
    match = difflib.get_close_matches(name, known, n=1, cutoff=_CUTOFF)
    return match[0] if match else None


def suggestion(message: str, known: Iterable[str]) -> str | None:
    """``did you mean X?`` for the unknown option(s) that ``message`` (a jsonargparse error) names, or None."""
    known = list(known)
    if found := _UNRECOGNIZED.search(message):
        options = [word.split("=", 1)[0] for word in found.group(1).split() if word.startswith("--")]
        matches = [close_match(option[2:], known) for option in options]
        return _did_you_mean([f"--{m}" for m in matches if m])
    if found := _GROUP.search(message):  # a group's key is relative to it, a subcommand's is the whole name
        kind, group, option = found.groups()
        return _did_you_mean([close_match(f"{group}.{option}" if kind == "Group" else option, known)])
    if found := _OPTION.search(message):
        prefix = _PARSER_KEY.search(message)
        if prefix and prefix.group(1) == "trainer.strategy" and "." not in found.group(1):
            return _did_you_mean([close_match(f"trainer.strategy.init_args.{found.group(1)}", known)])
        if not prefix:
            return _did_you_mean([close_match(found.group(1), known)])
    return None


def _did_you_mean(matches: list[str | None]) -> str | None:
    matches = [m for m in matches if m]
    return f"did you mean {' and '.join(matches)}?" if matches else None
