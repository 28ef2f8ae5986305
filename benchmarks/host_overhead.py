"""Host seconds per op, per saved tensor under the offloader's hooks, and per offloaded unit, measured on this CPU.

    python benchmarks/host_overhead.py            # writes benchmarks/results/host_overhead.json

A layer pass costs the host a Python call and a dispatch per op whatever the tensors' size; on a GPU the host must
issue them faster than the device runs them or the device waits (``planner.kernels``: a pass lasts the longer of its
device and host time). This times the engine's real step on a tiny model (d=32) where the kernels themselves cost
almost nothing, in thread CPU time (so other processes on a shared machine do not count; the least of 15 steps), with
2 and 10 layers: the difference over the 8 layers' ops (``planner.census``) is the host time per op. The same with the offloader's hooks
(``offload="none"``: pack and unpack in Python, no copy) gives the time per saved tensor, and with ``offload="full"``
(each unit copied: ``pool.take``, checks, ``copy_``) the time per unit beyond it (``planner.calibrate.host_seconds``,
which ``sppo-plan --calibrate`` runs on the GPU's host).

These are host figures of the machine that runs the script. ``sppo-plan --calibrate`` measures the GPU host's own
(``planner.calibrate``); the built-in h100 profile takes these from the development machine until one has run there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from lightning_sppo.planner.calibrate import host_seconds

OUT = Path(__file__).resolve().parent / "results" / "host_overhead.json"


def main() -> int:
    torch.set_num_threads(1)
    result = host_seconds("cpu") | {"cpu": _cpu(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
