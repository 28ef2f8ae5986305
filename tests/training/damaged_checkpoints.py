"""Damaged and forged checkpoints (``damaged.py``) given to every entry point that reads a checkpoint a user names.

Run by ``test_damaged_checkpoints.py`` (every case in one process, as ``untrusted_checkpoints.py`` runs its table),
or alone to print the table: ``python tests/training/damaged_checkpoints.py``. Each case must end as
``bad_inputs.check`` says: exit status 2 and one ``PROG: error:`` line naming the checkpoint (a Fabric call: one
``ValueError`` line of the package), no traceback. Before this table each of them ended in a traceback (an
``EOFError``, ``RuntimeError``, ``KeyError``, ``RecursionError``, ``AttributeError`` or DCP's ``CheckpointException``)
or, for a huge declared size, in an allocation of it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root on the path, as pytest has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.training.bad_inputs import Case, Outcome, _in, check, run_call, run_program
from tests.training.cli_runs import DEMO_TOKENS, copy_token_file
from tests.training.damaged import make_damaged
from tests.training.untrusted import OVERRIDES
from tests.training.untrusted_checkpoints import YAML

WHY = {
    "file-pickle-cut": "",
    "file-storage-missing": "file not found",
    "file-state-dict-list": "",
    "file-model-config-bad": "its model_config is not an architecture lightning-sppo builds",
    "file-init-from-loop": "a chain of checkpoints that loops",
    "file-huge-architecture": "is not that of its tensors",
    "folder-no-metadata": "it has no .metadata",
    "folder-metadata-cut": "",
    "folder-shard-cut": "(cut short?)",
    "folder-huge-tensor": "more than its shard files hold",
    "folder-meta-list": "it holds a list, not a checkpoint's dict of entries",
    "fabric-pickle-cut": "",
    "fabric-shard-cut": "(cut short?)",
    "fabric-entry-garbled": "UnicodeDecodeError",
}
"""What each line must say besides the checkpoint's name (empty: the name is enough)."""
ENTRIES = {
    "file-pickle-cut": ("export", "fit", "validate", "init_from"),
    "file-storage-missing": ("export", "fit", "validate", "init_from"),
    "file-state-dict-list": ("fit", "init_from"),
    "file-model-config-bad": ("export", "fit", "init_from"),
    "file-init-from-loop": ("export", "fit", "init_from"),
    "file-huge-architecture": ("init_from",),
    "folder-no-metadata": ("export", "fit", "validate", "init_from"),
    "folder-metadata-cut": ("export", "fit", "init_from"),
    "folder-shard-cut": ("export", "fit", "init_from"),
    "folder-huge-tensor": ("export", "fit", "init_from"),
    "folder-meta-list": ("export", "fit", "init_from"),
    "fabric-pickle-cut": ("fabric", "fabric-whole"),
    "fabric-shard-cut": ("fabric", "fabric-whole"),
    "fabric-entry-garbled": ("fabric", "fabric-whole"),
}
"""Which entry points read each (an entry point that reads only intact parts of a checkpoint is left out)."""


def _fabric_load(path: str, with_state: bool) -> None:
    import torch
    from lightning.fabric import Fabric

    from lightning_sppo import GPT, GPTConfig, SPPOStrategy

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    model = GPT(GPTConfig.from_name("tiny", **OVERRIDES))
    stage, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        fabric.load(path, {"model": stage, "optimizer": optimizer} if with_state else None)
    except Exception:
        raise
    except BaseException as error:  # DCP's CheckpointException: what a Fabric user's `except Exception` misses
        raise SystemError(f"a {type(error).__name__} (a BaseException) escaped: {str(error)[-300:]}") from None


def _case(name: str, entry: str) -> Case:
    path = f"{name}.ckpt"
    named = tuple(text for text in (path, WHY[name]) if text)
    if entry.startswith("fabric"):
        return Case(f"{entry}-{name}", "fabric", call=lambda: _fabric_load(path, entry == "fabric"), named=named)
    args = {
        "export": ("sppo-export", (path, f"hf-{name}")),
        "fit": ("sppo", ("fit", "--config", "my.yaml", "--ckpt_path", path)),
        "validate": ("sppo", ("validate", "--config", "my.yaml", "--ckpt_path", path)),
        "init_from": ("sppo", ("fit", "--config", "my.yaml", "--model.init_from", path)),
    }[entry]
    return Case(f"{entry}-{name}", *args, named=named)


CASES = [_case(name, entry) for name, entries in ENTRIES.items() for entry in entries]


def run_cases(work: Path, cases: list[Case] = CASES) -> dict[str, Outcome]:
    """Each case's outcome, in the scratch folder ``work`` (the damaged checkpoints, the config, the demo tokens)."""
    (work / "data").mkdir(parents=True)
    copy_token_file(DEMO_TOKENS, work / "data" / "demo")
    (work / "my.yaml").write_text(YAML)
    make_damaged(work)
    results = {}
    for case in cases:
        with _in(work):
            results[case.id] = run_call(case.call) if case.call else run_program(case.program, case.args)
    return results


if __name__ == "__main__":
    save_to = sys.argv[1] if len(sys.argv) > 1 else None  # a JSON file for every outcome in full
    with tempfile.TemporaryDirectory() as folder:
        results = run_cases(Path(folder) / "work")
    for case in CASES:
        problems = check(case, results[case.id])
        print(f"{case.id:40s} exit {results[case.id].code}  {'as it must' if not problems else '; '.join(problems)}")
    if save_to:
        Path(save_to).write_text(json.dumps({k: vars(o) for k, o in results.items()}, indent=1))
