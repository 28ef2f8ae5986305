"""The environment for processes a test starts: one thread per process.

CI has 2 cores, shared by the test process and every process it starts; OpenMP and tokenizer thread pools
sized to the machine in each of them oversubscribe it (the README's test command took 33 min under load,
8.5 min with one thread per process). Multi-rank workers started by ``tests/distributed/harness.py`` set
``torch.set_num_threads(1)`` themselves.
"""

from __future__ import annotations

import os

__all__ = ["LAUNCH_VARIABLES", "ONE_THREAD", "one_thread_env"]

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
"""Variables that cap the thread pools of torch (OpenMP, MKL) and of Hugging Face tokenizers."""


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip
"""What a process group started in the test process leaves in its environment (Lightning's ``_init_dist_connection``
sets ``MASTER_ADDR``/``MASTER_PORT`` and its store keeps that port while the process lives): a process a test starts
must not inherit them, or its own launch finds the port taken (EADDRINUSE) or joins the wrong group."""


def one_thread_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``LAUNCH_VARIABLES``, with ``ONE_THREAD`` and ``extra`` on top, for
    ``subprocess.run(env=...)``."""
    inherited = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    return inherited | ONE_THREAD | extra
