import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sched import SchedulerConfig


@pytest.mark.parametrize("options, field", [
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_model_len": 200},
     "max_num_batched_tokens"),
    ({"policy": "lifo"}, "policy"),
    ({"max_waiting_requests": 0}, "max_waiting_requests"),
    ({"kv_load_timeout_s": 0.0}, "kv_load_timeout_s"),
    ({"kv_load_failure_policy": "ignore"}, "kv_load_failure_policy"),
])
def test_bad_value_names_the_field(options, field):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field} "):
        SchedulerConfig(**options)


def test_defaults_are_valid_and_frozen():
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=256)
    assert (config.policy, config.kv_load_failure_policy) == ("fcfs", "recompute")
    assert config.max_waiting_requests is None
    with pytest.raises(AttributeError):
        config.max_num_seqs = 8


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, kvtier.sched; print('torch' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True, cwd=repo_root)
    assert result.stdout.strip() == "False"
