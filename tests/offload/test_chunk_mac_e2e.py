"""A shared tier someone else can write, end to end: with a chunk secret configured, chunks
whose payload was swapped (checksum recomputed, the old MAC kept or none) are misses and counted
errors, and the output stays token for token HF transformers' (tiny random Llama, fp32)."""

import os
import struct

import pytest
import xxhash

from kvtier import LLM, SamplingParams
from kvtier.offload.chunk_format import HEADER_BYTES, MAC_BYTES
from kvtier.offload.config import CONNECTOR_NAME, parse_kv_offload

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

PROMPT_LEN = 30
LOADABLE = 28  # 7 blocks of 4; the last token is always recomputed
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-mac")
    hf = make_hf_model("llama", directory, max_position_embeddings=256)
    prompts = random_prompts(2, PROMPT_LEN, seed=7)
    return str(directory), prompts, hf_greedy(hf, prompts, 4)


def _llm(model_dir, tier_dir, secret_file):
    extra = {**parse_kv_offload(f"host=1MiB,fs={tier_dir}"), "secret_file": str(secret_file)}
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=64, max_num_seqs=2,
               kv_transfer_config={"kv_connector": CONNECTOR_NAME,
                                   "kv_connector_extra_config": extra})


def _generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def _forge(tier_dir, keep_mac):
    """Swap the payloads of the chunk files in pairs, with checksums that match them."""
    paths = sorted(os.path.join(d, n) for d, _, names in os.walk(tier_dir)
                   for n in names if n.endswith(".kvc"))
    chunks = [open(path, "rb").read() for path in paths]
    for path, chunk, other in zip(paths, chunks, chunks[1:] + chunks[:1]):
        key_end = HEADER_BYTES + struct.unpack_from("<I", chunk, 8)[0]
        payload = other[key_end + MAC_BYTES:]
        flags = 1 if keep_mac else 0
        header = chunk[:6] + struct.pack("<H", flags) + chunk[8:HEADER_BYTES - 16] + \
            xxhash.xxh3_128(payload).digest()
        mac = chunk[key_end:key_end + MAC_BYTES] if keep_mac else b""
        with open(path, "wb") as f:
            f.write(header + chunk[HEADER_BYTES:key_end] + mac + payload)
    return len(paths)


@pytest.mark.parametrize("forgery", [None, "old_mac", "no_mac"])
def test_forged_chunks_are_counted_misses_with_a_secret(model, tmp_path, forgery):
    model_dir, prompts, expected = model
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    llm = _llm(model_dir, tmp_path / "tier", secret)
    try:
        assert _generate(llm, prompts)[0] == expected
    finally:
        llm.engine.shutdown()
    if forgery is not None:
        assert _forge(tmp_path / "tier", keep_mac=forgery == "old_mac") >= 2 * 7
    llm = _llm(model_dir, tmp_path / "tier", secret)  # a restart: only the fs tier has them
    try:
        tokens, cached = _generate(llm, prompts)
        # A request goes on once its first chunk failed; its later chunks' promotions may still
        # be failing: wait for every tier job before counting.
        assert llm.engine.scheduler.connector.flush(timeout_s=30)
        errors = llm.get_metrics().get('kvtier:offload_tier_errors_total{tier="fs"}', 0.0)
    finally:
        llm.engine.shutdown()
    assert tokens == expected
    if forgery is None:
        assert (cached, errors) == ([LOADABLE, LOADABLE], 0)
    else:
        # Each prompt's first chunk is promoted and fails its MAC, so the prompt is recomputed;
        # a later chunk's promotion may find the recomputed chunk in host memory first and not
        # read the file (on a fast machine, most runs): each read chunk fails, none loads.
        assert cached == [0, 0] and 2 <= errors <= 2 * 7
