"""OffloadingConnector end to end on LFM2 hybrids (short convolutions + attention): the conv
states travel with the KV as fixed-size pages, one state per chunk, and a request evicted from
the device resumes from them, token for token as HF transformers (fp32, greedy)."""

import pytest

from kvtier import LLM, SamplingParams
from kvtier.connector.offloading import OffloadingConnector, OffloadingConnectorWorker

from ..stores import ValkeyServer
from ..tiny_models import LFM2_MIXES, hf_greedy, make_lfm2_model, random_prompts

PROMPT_LEN = 30  # 7 loadable blocks of 4 (the last token is always recomputed)
LOADABLE = 28
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Bytes of one block of one layer (fp32): attention K + V, 4 tokens x 2 kv heads x 16; a conv
# state, (taps - 1) x hidden 64.
ATTENTION_PAGE = 2 * 4 * 2 * 16 * 4


def _state_page(num_taps: int) -> int:
    return (num_taps - 1) * 64 * 4


@pytest.fixture(scope="module", params=sorted(LFM2_MIXES))
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_lfm2_model(request.param, directory, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN)
    layer_types = LFM2_MIXES[request.param][0]
    # (attention bytes, state bytes) of one chunk of one block
    chunk = (layer_types.count("full_attention") * ATTENTION_PAGE,
             layer_types.count("conv") * _state_page(hf.config.conv_L_cache))
    return str(directory), prompts, hf_greedy(hf, prompts, MAX_TOKENS), chunk


def _llm(model_dir, **kwargs):
    # 48 device blocks hold 3 of the 8-block prompts in both groups: earlier ones get evicted.
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=48, max_num_seqs=2,
               **kwargs)


def _generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def _generate_one_by_one(llm, prompts, expected):
    """Each prompt after the previous one's copies to the tiers ended (see the Llama test)."""
    for prompt, want in zip(prompts, expected):
        assert _generate(llm, [prompt])[0] == [want]
        llm.engine.step()
        assert llm.engine.scheduler.connector.flush(timeout_s=30), "cascade to the tiers hangs"


def _metric(metrics, name, label):
    return metrics.get(f"kvtier:offload_{name}_total{{{label}}}", 0.0)


def test_evicted_from_device_resumes_from_host_states(model):
    model_dir, prompts, expected, (attention, state) = model
    llm = _llm(model_dir, kv_offload="host=1MiB")
    try:
        assert _generate(llm, prompts[:4]) == (expected[:4], [0] * 4)
        tokens, cached = _generate(llm, prompts[:1])
        metrics = llm.get_metrics()
        assert tokens == expected[:1] and cached == [LOADABLE]
        # 7 attention chunks, and of the states only the one after token 28.
        assert _metric(metrics, "bytes", 'direction="host_to_device"') == 7 * attention + state
        # 8 blocks of each prompt (the 8th filled by decoding): a state for each too.
        assert _metric(metrics, "bytes", 'direction="device_to_host"') == 4 * 8 * (
            attention + state)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.mark.parametrize("tier", ["disk", "fs", "redis"])
def test_evicted_from_host_resumes_from_tier_states(model, tmp_path, tier, request):
    """The state pages go wherever the attention chunks go: a local disk tier, a shared
    directory, a Valkey store other instances read too."""
    model_dir, prompts, expected, chunk = model
    flag = {"disk": f"disk={tmp_path}:64MiB", "fs": f"fs={tmp_path}"}.get(tier)
    if tier == "redis":
        valkey = request.getfixturevalue("valkey")
        valkey.client().flushall()  # each layer mix starts from an empty store
        flag = f"redis={valkey.url}"
    # 24 host slots (each fits the larger chunk): a prompt stores 16 chunks, so the first
    # prompts leave host memory, and the two asked again fit with room to spare.
    llm = _llm(model_dir, kv_offload=f"host={24 * max(chunk)},{flag}")
    try:
        _generate_one_by_one(llm, prompts, expected)
        tokens, cached = _generate(llm, prompts[:2])
        metrics = llm.get_metrics()
        assert tokens == expected[:2] and cached == [LOADABLE, LOADABLE]
        # 7 attention chunks and the last state of each prompt come back from the tier.
        assert _metric(metrics, "tier_hits", f'tier="{tier}"') >= 2 * 8
        assert _metric(metrics, "tier_errors", f'tier="{tier}"') == 0
    finally:
        llm.engine.shutdown()



class FaultyOffloadWorker(OffloadingConnectorWorker):
    """Loads like OffloadingConnector, then reports the third block each request loads into
    group 0 (attention) invalid, scribbled over."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self._bad_blocks: set[int] = set()

    def start_load_kv(self, forward_context) -> None:
        loaded: dict[str, list[int]] = {}
        for transfer in self.connector_metadata.loads:
            if transfer.group_id == 0:
                loaded.setdefault(transfer.req_id, []).extend(transfer.block_ids)
        self._bad_blocks.update(ids[2] for ids in loaded.values() if len(ids) > 2)
        super().start_load_kv(forward_context)

    def get_block_ids_with_load_errors(self):
        reported, self._bad_blocks = self._bad_blocks, set()
        for block_id in reported:
            for cache in self.kv_caches.values():
                cache[:, block_id].fill_(1e4)
        return super().get_block_ids_with_load_errors() | reported


def test_a_bad_loaded_block_restarts_the_request(model, monkeypatch):
    """Block 2 (tokens 8..11) of each reload arrives bad. Attention alone would resume at token
    8, but only the conv state after token 28 was loaded: the request starts over."""
    model_dir, prompts, expected, _ = model
    monkeypatch.setattr(OffloadingConnector, "worker_cls", FaultyOffloadWorker)
    llm = _llm(model_dir, kv_offload="host=1MiB")
    try:
        assert _generate(llm, prompts[:4])[0] == expected[:4]
        assert _generate(llm, prompts[:2])[0] == expected[:2]
        assert llm.get_metrics()["kvtier:kv_load_failures"] == 2
    finally:
        llm.engine.shutdown()
