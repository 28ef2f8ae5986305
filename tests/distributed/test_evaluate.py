"""Forward-only evaluation through a pipeline and sequence parallelism equals the plain model (gloo processes)."""

import pytest

from tests.distributed import workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.slow  # several processes (gloo) per test

# (pp, dp, sp, schedule, micro-batches) on 2 processes: the "sppo" schedule evaluates with the forward-only
# one; sp=2 and dp=2 shard the stage with FSDP (fsdp_sync="step" leaves weights gathered after forwards).
CASES = [(2, 1, 1, "seq1f1b", 2), (2, 1, 1, "sppo", 1), (1, 1, 2, "seq1f1b", 1), (1, 2, 1, "seq1f1b", 1)]


def test_evaluate_matches_plain_model_then_training_still_does():
    run_distributed(workers.evaluate_parity, 2, CASES)
