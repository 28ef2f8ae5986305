"""Malicious checkpoints (``untrusted.py``) given to every entry point that reads a checkpoint a user names (issue 36).

Run by ``test_untrusted_checkpoints.py`` (every case in one process, as ``bad_inputs.py`` runs its table), or alone to
print the table: ``python tests/training/untrusted_checkpoints.py``. Each case must end as ``bad_inputs.check`` says
(exit status 2 and one ``PROG: error:`` line naming the file and the global it asked for; a Fabric call raises a
one-line ``UnsafeCheckpointError``), and the command in the checkpoint must never have run (no marker file).

Before issue 36 nine of the ten (entry point, file or folder) pairs ran it; Fabric's load of a single file on one
process already refused it (PyTorch's ``weights_only`` default).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repository root on the path, as pytest has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.training.bad_inputs import Case, Outcome, _in, check, run_call, run_program
from tests.training.untrusted import FIXTURES, KINDS, OVERRIDES, make_untrusted

ROOT = Path(__file__).resolve().parents[2]
MARKER = "CODE-RAN"
"""The file the malicious checkpoints' command creates, in the scratch folder."""
YAML = f"""\
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  model: tiny
  model_overrides: {json.dumps(OVERRIDES)}
data:
  path: data/demo
  seq_len: 32
  batch_size: 2
  val_fraction: 0.15
"""
REFUSED_AT = {
    "file": "untrusted-file.ckpt:",
    "folder-meta": "untrusted-folder-meta.ckpt/meta.pt:",
    "folder-metadata": "untrusted-folder-metadata.ckpt/.metadata:",
    "folder-entry": "untrusted-folder-entry.ckpt (entry 'note'):",
}
"""What each refusal names as the file it read (the checkpoint, or the file of the folder that asks for code)."""
READS_ONLY_THE_MODEL = "folder-entry"
"""sppo-export and --model.init_from read a folder's model tensors only: its other entries are never unpickled."""


def _fabric_load(path: str, with_state: bool, weights_only: bool | None = None) -> None:
    import torch
    from lightning.fabric import Fabric

    from lightning_sppo import GPT, GPTConfig, SPPOStrategy

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    model = GPT(GPTConfig.from_name("tiny", **OVERRIDES))
    stage, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = {"model": stage, "optimizer": optimizer} if with_state else None
    fabric.load(path, state, weights_only=weights_only)


def _cases() -> list[Case]:
    cases = []
    for kind in KINDS:
        path = f"untrusted-{kind}.ckpt"
        named = (REFUSED_AT[kind], "posix.system")
        refused = {"named": named}
        model_only = {"code": 0, "error_lines": 0} if kind == READS_ONLY_THE_MODEL else refused
        cases += [
            Case(f"export-{kind}", "sppo-export", (path, f"hf-{kind}"), **model_only),
            Case(f"fit-ckpt_path-{kind}", "sppo", ("fit", "--config", "my.yaml", "--ckpt_path", path), **refused),
            Case(f"validate-ckpt_path-{kind}", "sppo", ("validate", "--config", "my.yaml", "--ckpt_path", path),
                 **refused),
            Case(f"fit-init_from-{kind}", "sppo", ("fit", "--config", "my.yaml", "--model.init_from", path),
                 **model_only),
            Case(f"fabric-load-{kind}", "fabric", call=lambda path=path: _fabric_load(path, True), named=named),
            Case(f"fabric-load-whole-{kind}", "fabric", call=lambda path=path: _fabric_load(path, False), named=named),
        ]  # fmt: skip
    fixture = str(FIXTURES / "fit-1dev.ckpt")
    weights_only = ("weights_only=False", "docs/checkpoints.md")
    return cases + [
        Case("fit-weights_only-false", "sppo", ("fit", "--config", "my.yaml", "--ckpt_path", fixture,
                                                "--weights_only", "false"), named=weights_only),
        Case("fabric-load-weights_only-false", "fabric", call=lambda: _fabric_load(fixture, True, weights_only=False),
             named=weights_only),
    ]  # fmt: skip


CASES = _cases()


def prepare_folder(work: Path) -> None:
    """The malicious checkpoints, the config and the demo tokens in the scratch folder ``work``."""
    (work / "data").mkdir(parents=True)
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(ROOT / "data" / f"demo{suffix}", work / "data" / f"demo{suffix}")
    (work / "my.yaml").write_text(YAML)
    make_untrusted(work, work / MARKER)


def run_cases(work: Path, cases: list[Case] = CASES) -> dict[str, tuple[Outcome, bool]]:
    """Each case's outcome and whether the checkpoint's command ran (the marker appeared)."""
    prepare_folder(work)
    results = {}
    for case in cases:
        with _in(work):
            outcome = run_call(case.call) if case.call else run_program(case.program, case.args)
        results[case.id] = (outcome, (work / MARKER).exists())
        (work / MARKER).unlink(missing_ok=True)
    return results


if __name__ == "__main__":
    save_to = sys.argv[1] if len(sys.argv) > 1 else None  # a JSON file for every outcome in full
    with tempfile.TemporaryDirectory() as folder:
        results = run_cases(Path(folder) / "work")
    for case in CASES:
        outcome, ran = results[case.id]
        problems = check(case, outcome) + (["the checkpoint's code ran"] if ran else [])
        print(f"{case.id:40s} exit {outcome.code}  {'as it must' if not problems else '; '.join(problems)}")
    if save_to:
        Path(save_to).write_text(json.dumps({k: [vars(o), ran] for k, (o, ran) in results.items()}, indent=1))
