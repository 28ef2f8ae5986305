"""The repository's promises: CI runs README's test command, and the demo learns."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci_command in readme.splitlines(), ci_command


def test_constraints_pin_torch():
    assert "torch==" in (ROOT / "constraints.txt").read_text()


def test_demo_loss_falls():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_fabric", ROOT / "recipes" / "demo_fabric.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    losses = demo.main(seq_len=128, batch_size=2, num_subsequences=3, steps=30, log_every=10)
    assert losses[-1] < losses[0] - 1.0, losses
