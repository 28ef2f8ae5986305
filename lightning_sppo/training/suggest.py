""" "Did you mean ...?" for an option or config key the ``sppo`` command does not know.

jsonargparse names the unknown option in one of three ways, and each is matched here to the known names of its
namespace (``difflib``, the closest one only):

* ``unrecognized arguments: --model.learning_rat 1e-3`` (command line): ``--model.learning_rate``;
* ``Subcommand 'fit' does not accept option 'model.learning_rat'`` or ``Group 'model' does not accept option
  'learning_rat'`` (a key of a config file): ``model.learning_rate``;
* ``Option 'modle.model' is not accepted`` (a misspelt top-level key): ``model.model``; under
  ``Parser key "trainer.strategy"`` the settings of ``SPPOTrainerStrategy``:
  ``trainer.strategy.init_args.pipeline_parallel``;
* ``Problem with given class_path 'lightning_sppo.callbacks.SPPOCheckpoint': Option 'every_n_train_step' is not
  accepted`` (a key inside any class's ``init_args``: a callback, a logger, a strategy, a data module): the
  closest argument of that class's constructor (and of its bases', where it passes ``**kwargs`` on).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable
from importlib import import_module

__all__ = ["close_match", "init_parameters", "known_options", "suggestion"]

_CUTOFF = 0.6  # difflib's default: "learning_rat" -> "learning_rate" (0.96), unrelated words stay below
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_GROUP = re.compile(r"(Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)'")
_OPTION = re.compile(r"Option '([\w.]+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')
_CLASS_OPTION = re.compile(r"Problem with given class_path '([\w.]+)':\s*Option '(\w+)' is not accepted")


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
    if found := _CLASS_OPTION.search(message):
        key = _PARSER_KEY.search(message)
        listed = "Given value type: <class 'list'>" in message  # one entry of a list (callbacks, loggers)
        return _init_args_match(found.group(1), found.group(2), key.group(1) if key else None, listed)
    if found := _OPTION.search(message):
        prefix = _PARSER_KEY.search(message)
        if prefix and prefix.group(1) == "trainer.strategy" and "." not in found.group(1):
            return _did_you_mean([close_match(f"trainer.strategy.init_args.{found.group(1)}", known)])
        if not prefix:
            return _did_you_mean([close_match(found.group(1), known)])
    return None


def _init_args_match(class_path: str, option: str, key: str | None, listed: bool) -> str | None:
    """``did you mean`` the closest constructor argument of ``class_path`` to ``option``, named where it goes: a
    dotted name for a setting that holds one class, the entry's ``init_args`` key for one of a list."""
    names = init_parameters(class_path)
    match = difflib.get_close_matches(option, names, n=1, cutoff=_CUTOFF)
    if not match:
        return None
    if key and not listed:
        return f"did you mean {key}.init_args.{match[0]} (an argument of {class_path})?"
    where = f", in {key}" if key else ""
    return f"did you mean init_args.{match[0]} (an argument of {class_path}{where})?"


def init_parameters(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s constructor takes by name, with those of its bases where it passes
    ``**kwargs`` on (as jsonargparse reads them); empty for a class that cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ()):
        if "__init__" not in vars(klass) or klass is object:
            continue
        try:
            parameters = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            break
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names += [p.name for p in parameters if p.kind in named and p.name != "self" and p.name not in names]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    return names


def _did_you_mean(matches: list[str | None]) -> str | None:
    matches = [m for m in matches if m]
    return f"did you mean {' and '.join(matches)}?" if matches else None
