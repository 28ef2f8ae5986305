"""Checkpoints across every layout the strategy accepts (gloo, real processes), both formats, both schedules.

One launch per layout. The launches form a chain (``checkpoint_workers.LAYOUTS``): each loads what the
previous layout saved, steps and saves again; the files are checked against the plain GPT after as many
steps. Running one layout's test alone runs the launches before it first.
"""

import pytest

from tests.distributed import checkpoint_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test

LAYOUTS = checkpoint_workers.LAYOUTS


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Runs the chain's launches up to a given index, each once per test session."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    done: set[int] = set()

    def run_up_to(index: int) -> None:
        for i in range(index + 1):
            if i not in done:
                pp, dp, sp = LAYOUTS[i]
                run_distributed(checkpoint_workers.layout_chain_link, pp * dp * sp, i, str(tmp))
                done.add(i)

    return run_up_to


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"pp{pp}-dp{dp}-sp{sp}" for pp, dp, sp in LAYOUTS])
def test_layout_saves_what_the_plain_model_holds_and_loads_the_previous_layout(chain, index):
    chain(index)


def test_incomplete_saves_and_mismatched_loads_raise_on_every_rank(tmp_path):
    run_distributed(checkpoint_workers.checkpoint_errors_on_every_rank, 4, str(tmp_path))
