"""LLM(): options are checked before a model is loaded."""

import pytest

from kvtier import LLM


@pytest.mark.parametrize("options, message", [
    ({"kv_offload": "host=bad"}, "^kv_offload host must be a byte size such as 4GiB, 512MiB or "
                                 "1073741824, got 'bad'$"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 1,
                                                           "secondary_tiers": [{"type": "tape"}]}}},
     "unknown secondary tier type 'tape'"),
])
def test_bad_offload_option_fails_before_the_model_loads(tmp_path, options, message):
    # The model does not exist: an error about it would mean it was loaded first.
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "no-such-model"), **options)
