"""Steps/s of the README's minimal config (``sppo fit``, one CPU process) with one intra-op thread, the ``sppo``
command's CPU default, against torch's default (one thread per core), set through ``OMP_NUM_THREADS``.

    python benchmarks/cpu_threads.py                      # 3 alternating runs of each, 60 steps
    python benchmarks/cpu_threads.py --repeats 5 --steps 100 --threads 1 2 4

Each run is a fresh ``sppo fit`` process; the rate is measured from step 10 to the last step (start-up and the
first steps left out), on the CPU times the machine gives it: run it on an idle machine, and read the ratio.
Prints one JSON line per run and a summary (median steps/s per thread count).

Measured for issue 30 (lightning-sppo at the commit that made one thread the CPU default; 2 cores shared with
other work, load average 8.2 at the start and 18.0 at the end; torch 2.13 CPU): ``--repeats 3 --steps 60``

    threads=1: 10.33, 6.52, 8.95 steps/s (median 8.95)
    threads=2 (torch's default here, one per core): 0.39, 0.89, 0.37 steps/s (median 0.39, 0.044x)

The issue measured 19 against 0.64 steps/s on another machine (about 30x). On an idle machine the gap is smaller;
one thread was never the slower for this model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = """\
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: cpu_threads.StepRate
model:
  model: tiny
data:
  path: {data}
  seq_len: 256
  batch_size: 4
"""
_SKIP = 10  # steps left out of the rate (start-up, the planner's first batch)


class StepRate(L.Callback):
    """Writes ``{"steps_per_s": ..., "threads": ...}`` to ``$SPPO_STEP_RATE`` at the end of fit."""

    def __init__(self) -> None:
        self.start: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == _SKIP:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        rate = (trainer.global_step - _SKIP) / (time.perf_counter() - self.start)
        Path(os.environ["SPPO_STEP_RATE"]).write_text(
            json.dumps({"steps_per_s": rate, "threads": torch.get_num_threads()})
        )


def run(threads: int | None, steps: int, work: Path) -> dict:
    out = work / "rate.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env |= {"SPPO_STEP_RATE": str(out), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(work / "my.yaml")]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    args = parser.parse_args()
    rates: dict[int, list[float]] = {t: [] for t in args.threads}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "my.yaml").write_text(MINIMAL.format(steps=args.steps, data=ROOT / "data" / "demo"))
        for repeat in range(args.repeats):
            for threads in args.threads:  # alternating, so a change of load hits every setting alike
                result = run(threads, args.steps, work)
                rates[threads].append(result["steps_per_s"])
                print(json.dumps({"repeat": repeat, "omp_num_threads": threads} | result), flush=True)
    medians = {t: statistics.median(r) for t, r in rates.items()}
    base = medians[args.threads[0]]
    summary = {
        f"threads={t}": {"median_steps_per_s": round(m, 2), "vs_first": round(m / base, 3)} for t, m in medians.items()
    }
    print(json.dumps({"cpus": os.cpu_count(), "load_average": os.getloadavg()} | summary))


if __name__ == "__main__":
    main()
