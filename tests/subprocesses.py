"""The environment for processes a test starts: one thread per process.

CI has 2 cores, shared by the test process and every process it starts; OpenMP and tokenizer thread pools
sized to the machine in each of them oversubscribe it (the README's test command took 33 min under load,
8.5 min with one thread per process). Multi-rank workers started by ``tests/distributed/harness.py`` set
``torch.set_num_threads(1)`` themselves.
"""

from __future__ import annotations

import os

__all__ = ["ONE_THREAD", "one_thread_env"]

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
"""Variables that cap the thread pools of torch (OpenMP, MKL) and of Hugging Face tokenizers."""


def one_thread_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``ONE_THREAD`` and ``extra`` on top, for ``subprocess.run(env=...)``."""
    return os.environ | ONE_THREAD | extra
