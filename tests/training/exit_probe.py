"""``SPPO_TEST_THREADS_AT_EXIT=PREFIX python tests/training/exit_probe.py fit ...``: the ``sppo`` command, writing
to ``PREFIX.<local rank>`` the threads still running in its process once it has returned, before the exit hooks
registered on importing ``lightning_sppo`` (``failures.stop_watching_peers``, a safety net: exit hooks run last
registered first), so what it sees is what the command's own shutdown left. Lightning's launcher starts the other
ranks with this same command line and environment."""

from __future__ import annotations

import atexit
import json
import os
import threading


def _threads_at_exit() -> None:
    python = sorted(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
    native = []
    for task in sorted(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else []:
        with open(f"/proc/self/task/{task}/comm") as f:
            native.append(f.read().strip())
    with open(f"{os.environ['SPPO_TEST_THREADS_AT_EXIT']}.{os.environ.get('LOCAL_RANK', '0')}", "w") as f:
        json.dump({"python": python, "native": native}, f)


if __name__ == "__main__":
    from lightning_sppo.training.cli import main

    atexit.register(_threads_at_exit)  # after lightning_sppo's own exit hooks: runs before them
    main()
