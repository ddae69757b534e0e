"""A workload entry's prompt and max_tokens are refused by the scheduler's admission rule itself."""

import pytest

from kvjax import KVGroupSpec
from kvjax.cli.workload import WorkloadError, validate_workload
from kvjax.host.buckets import BucketSpec
from kvjax.host.scheduler import Request, Scheduler


@pytest.mark.parametrize("prompt, max_tokens", [
    ([], 2), (None, 2), ("abc", 2), ([1] * 32, 2), ([1] * 40, 1),
    ([1], 0), ([1], -1), ([1], 1.5), ([1], True), ([1], None),
    ([1] * 40, 0), ([1] * 40, None), ([], 0),  # two faults: the scheduler's first one
])
def test_a_workload_entry_is_refused_as_the_scheduler_refuses_its_request(prompt, max_tokens):
    sched = Scheduler((KVGroupSpec(16, 4),), BucketSpec.default(32, 4), num_blocks=64, max_model_len=32)
    with pytest.raises(ValueError) as want:
        sched.add_request(Request("a", prompt, max_tokens))
    with pytest.raises(WorkloadError) as got:
        validate_workload({"requests": [{"id": "a", "prompt": prompt, "max_tokens": max_tokens}]},
                          vocab_size=256, max_model_len=32)
    assert str(got.value) == str(want.value)
