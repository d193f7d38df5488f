"""LLM(): options are checked before a model is loaded; shutdown keeps what the tiers hold
and releases them."""

import subprocess
import sys

import pytest

from kvtier import LLM, SamplingParams

from ..tiny_models import make_hf_model, make_lfm2_model


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_llm")
    make_hf_model("llama", directory)
    return str(directory)


PROMPT = list(range(3, 67))  # 16 blocks of 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _disk_llm(model_dir: str, disk_dir) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=64,
               kv_offload=f"host=1MiB,disk={disk_dir}:8MiB,write=back")


def test_shutdown_writes_back_and_releases_the_disk_tier(model_dir, tmp_path):
    with _disk_llm(model_dir, tmp_path) as llm:
        first = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    with _disk_llm(model_dir, tmp_path) as again:  # the directory's lock was released
        second = again.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
    assert second.num_cached_tokens > 0  # from the disk: the device cache started empty
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_an_llm_never_shut_down_writes_back_at_exit(model_dir, tmp_path):
    script = (f"from kvtier import LLM, SamplingParams\n"
              f"llm = LLM({model_dir!r}, dtype='float32', block_size=4, num_device_blocks=64, "
              f"kv_offload='host=1MiB,disk={tmp_path}:8MiB,write=back')\n"
              f"llm.generate({{'prompt_token_ids': {PROMPT!r}}}, "
              f"SamplingParams(temperature=0.0, max_tokens=4))\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    with _disk_llm(model_dir, tmp_path) as llm:
        assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].num_cached_tokens > 0


def test_a_tier_that_cannot_start_releases_the_tiers_started_before_it(model_dir, tmp_path):
    with pytest.raises(ValueError, match="holds no chunk"):
        LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=64,
            kv_offload=f"host=1MiB,disk={tmp_path / 'a'}:8MiB,disk={tmp_path / 'b'}:5000")
    _disk_llm(model_dir, tmp_path / "a").shutdown()  # not "in use by another instance"


def test_an_engine_that_fails_after_its_tiers_started_releases_them(tmp_path):
    make_lfm2_model("conv_attn", tmp_path / "lfm2")
    options = {"dtype": "float32", "block_size": 4, "num_device_blocks": 24,
               "kv_offload": f"host=1MiB,disk={tmp_path / 'disk'}:4MiB"}
    # Refused once the tiers run: speculative decoding needs an attention-only model.
    with pytest.raises(ValueError, match="speculative decoding needs an attention-only model"):
        LLM(str(tmp_path / "lfm2"), **options,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    LLM(str(tmp_path / "lfm2"), **options).shutdown()  # not "in use by another instance"
