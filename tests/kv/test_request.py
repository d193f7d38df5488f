"""Request token bookkeeping and status helpers; importing kvtier.kv without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.kv import MultiModalFeature, Request, RequestStatus
from kvtier.sampling_params import SamplingParams


def test_token_counts_follow_appends():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=7))
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (6, 3, 3)
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert r.output_token_ids == [4, 5, 6]
    assert r.max_tokens == 7
    assert Request("n", [1]).max_tokens is None
    assert (r.status, r.num_computed_tokens, r.num_cached_tokens) == (
        RequestStatus.WAITING, 0, None)


@pytest.mark.parametrize("status, finished, reason", [
    (RequestStatus.WAITING, False, None),
    (RequestStatus.WAITING_FOR_REMOTE_KVS, False, None),
    (RequestStatus.RUNNING, False, None),
    (RequestStatus.PREEMPTED, False, None),
    (RequestStatus.FINISHED_STOPPED, True, "stop"),
    (RequestStatus.FINISHED_LENGTH_CAPPED, True, "length"),
    (RequestStatus.FINISHED_ABORTED, True, "abort"),
    (RequestStatus.FINISHED_ERROR, True, "error"),
])
def test_status_helpers(status, finished, reason):
    assert RequestStatus.is_finished(status) is finished
    assert RequestStatus.get_finished_reason(status) == reason
    r = Request("r", [1])
    r.status = status
    assert (r.is_finished(), r.get_finished_reason()) == (finished, reason)


def test_requests_order_by_priority_then_arrival():
    late_urgent = Request("a", [1], arrival_time=5.0, priority=0)
    early_normal = Request("b", [1], arrival_time=1.0, priority=1)
    early_urgent = Request("c", [1], arrival_time=1.0, priority=0)
    assert sorted([early_normal, late_urgent, early_urgent]) == [
        early_urgent, late_urgent, early_normal]


def test_bad_multimodal_feature_names_the_field():
    with pytest.raises(ValueError, match="offset"):
        MultiModalFeature("img", -1, 4)
    with pytest.raises(ValueError, match="length"):
        MultiModalFeature("img", 0, 0)


def test_importing_kvtier_kv_does_not_import_torch():
    script = "import sys, kvtier.kv; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "False"
