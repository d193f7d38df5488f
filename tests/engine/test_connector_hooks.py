"""The runner calls a connector's worker hooks in the connector contract's order, every step."""

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy, make_hf_model
from . import recording_connector

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def step_calls(finished: tuple[str, ...] = ()) -> list[tuple]:
    per_layer = [call for layer in LAYERS
                 for call in (("wait_for_layer_load", layer), ("save_kv_layer", layer))]
    return [("bind_connector_metadata",), ("start_load_kv",), *per_layer, ("wait_for_save",),
            ("get_finished", finished), ("get_block_ids_with_load_errors",), ("get_stats",),
            ("take_events",), ("clear_connector_metadata",)]


def test_hook_sequence_per_step_and_unchanged_tokens(tmp_path):
    hf_model = make_hf_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_device_blocks=32,
              kv_transfer_config={"kv_connector": "RecordingConnector",
                                  "kv_connector_module_path": "tests.engine.recording_connector"})
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, [prompt], 3)[0]
    calls = recording_connector.CALLS
    assert calls[0] == ("register_kv_caches", tuple(LAYERS))
    # Three steps (prefill, two decodes) with every layer hooked; the finished id is reported
    # to get_finished on the step after it finished, which this run does not reach.
    assert calls[1:] == step_calls() * 3
    llm.engine.check_invariants()
