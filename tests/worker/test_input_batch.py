import torch

from kvtier.sampling_params import SamplingParams
from kvtier.worker.input_batch import InputBatchBuilder
from kvtier.worker.request_state import RequestState

CPU = torch.device("cpu")


def state(req_id, token_ids, block_ids, num_computed, num_prompt=None):
    return RequestState(req_id, list(token_ids), num_prompt or len(token_ids), SamplingParams(),
                        block_ids, num_computed)


def test_mixed_step_builds_exact_positions_slots_and_tables():
    builder = InputBatchBuilder(num_groups=2, block_size=4, max_num_seqs=4, max_num_tokens=16,
                                max_blocks_per_seq=8, device=CPU)
    # a: chunk of 3 over 5 computed tokens of a 10-token prompt (does not sample).
    a = state("a", range(100, 110), [[7, 3, 9], [0, 3, 9]], num_computed=5)
    # b: decode of its 7th token (all known tokens computed after this step: samples).
    b = state("b", range(200, 207), [[4, 8], [4, 8]], num_computed=6, num_prompt=5)
    batch = builder.build([(a, 3), (b, 1)], hooks=None)
    assert batch.input_ids.tolist() == [105, 106, 107, 206]
    assert batch.positions.tolist() == [5, 6, 7, 6]
    meta = batch.metadata
    assert meta.query_start_loc.tolist() == meta.query_start_loc_list == [0, 3, 4]
    assert (meta.seq_lens, meta.num_computed, meta.is_decode_only) == ([8, 7], [5, 6], False)
    assert meta.block_tables[0].tolist() == [[7, 3, 9], [4, 8, 0]]
    assert meta.block_tables[1].tolist() == [[0, 3, 9], [4, 8, 0]]
    # slot = block id * 4 + position % 4
    assert meta.slot_mapping[0].tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 8 * 4 + 2]
    assert batch.sampling == [b]
    assert batch.logits_indices.tolist() == [3]


def test_buffers_are_reused_and_stale_rows_cleared():
    builder = InputBatchBuilder(num_groups=1, block_size=2, max_num_seqs=2, max_num_tokens=4,
                                max_blocks_per_seq=2, device=CPU)
    long = state("x", range(5), [[1, 2, 3]], num_computed=0)
    first = builder.build([(long, 5)], hooks=None)
    assert first.positions.tolist() == [0, 1, 2, 3, 4]  # grew past max_num_tokens
    assert first.metadata.slot_mapping[0].tolist() == [2, 3, 4, 5, 6]
    short = state("y", [9], [[5]], num_computed=0)
    second = builder.build([(short, 1)], hooks=None)
    assert second.metadata.block_tables[0].tolist() == [[5]]
    assert second.metadata.is_decode_only
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()
