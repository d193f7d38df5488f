"""`kvtier plan calibrate`: measure this machine with a model and fit the planner's cost model.

A few batches of random-token prompts run through the engine (prefix caching off, greedy, no
early stop) with the engine's default scheduler limits, and every engine step is timed on its
own. What a step did is read from its requests' computed tokens before and after it: the
prefill chunks (tokens, and the attention pairs of each chunk after its context) and the
decoding sequences (their number, and the context each attends to). The batches make the steps
the engine takes under load: a prompt alone, many short prompts prefilled together and then
128 sequences decoding, long prompts whose decodes read long contexts, and the steps between
them that mix prefill chunks with decodes. One least-squares fit of seconds per step against
(1, prefill tokens, decoding sequences, prefill attention pairs, context tokens decoded
against) gives the step costs, each step weighted by its own time so that a 20 ms decode step
is fitted as closely as a 2 s prefill. Host loads are timed as a copy of a buffer in memory,
disk loads as a read of a file written, synced and dropped from the page cache first (where the
OS allows), so both are per-byte costs of this machine. Given the tiers served with, and a
server, each batch also runs with those tiers and through that server, right after it ran
alone, for the cost of the stores and of serving (see `calibrate`).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.planner.calibrate_served import ServedBatch, ServedClient, fit_served
from kvtier.planner.cost_model import CostModel, prefill_pairs
from kvtier.planner.fit import nonnegative_fit
from kvtier.planner.model_kv import model_kv, read_model_config

# (sequences, prompt tokens of each, output tokens of each), queued at once. Prompts longer
# than half the model's context are cut to fit it.
BATCHES = ((1, 128, 1), (1, 512, 1), (1, 1024, 1), (1, 2048, 1), (128, 32, 8), (16, 512, 8),
           (4, 2048, 8))
_COPY_BYTES = 64 * 1024 * 1024
# After a batch with tiers or a served one, the stores still running finish before the next
# batch is timed; a batch's own steps wait for most of them.
_SETTLE_S = 1.0


@dataclass(frozen=True)
class Measurement:
    """One engine step and its seconds: `prefill_tokens` over its prefill chunks with
    `prefill_pairs` attention pairs in all, and `decode_seqs` decoding sequences attending to
    `decode_context` tokens in all."""

    prefill_tokens: int
    decode_seqs: int
    step_s: float
    prefill_pairs: int = 0
    decode_context: int = 0

    def features(self) -> list[float]:
        """The step's (1, prefill tokens, decoding seqs, attention pairs, context decoded)."""
        return [1.0, self.prefill_tokens, self.decode_seqs, self.prefill_pairs,
                self.decode_context]


@dataclass(frozen=True)
class Calibration:
    """A calibration's cost model and the raw timings it was fitted to: the engine's steps
    (Measurement), and with a server the batches served (calibrate_served.ServedBatch)."""

    cost: CostModel
    measurements: list[dict]
    served_measurements: list[dict] | None = None


@dataclass
class BatchRuns:
    """One calibration batch's seconds, summed over its runs: in the engine alone (`steps`:
    the steps of its last run there), with the tiers, and served."""

    steps: list[Measurement]
    plain_s: float = 0.0
    offload_s: float = 0.0
    served_s: float = 0.0


def calibrate(model: str | None, dtype: str = "auto", device: str | None = None,
              disk_dir: str | None = None, repeats: int = 2, block_size: int = 16,
              kv_offload: str | None = None, served_url: str | None = None,
              kv_cache_dtype: str = "auto") -> Calibration:
    """Measure and fit. Measure with the block size the engine will serve with: the attention
    kernels differ by block size (the vectorised CPU ones take 16-token blocks), and so do the
    step costs. With `kv_offload` (the engine's flag) each batch also runs, right after, in a
    second engine with those tiers and prefix caching on, as it serves: every chunk it computes
    is stored, and what that takes beyond the batch in the engine alone is the stores' cost
    (store_costs). With `served_url`, a `kvtier serve` of the same model and flags, each batch
    is then served too, and what serving adds is fitted (calibrate_served). Run side by side,
    batch by batch, the three meet the same load from the machine's other jobs."""
    from kvtier.engine.llm import LLM

    # Before the engines load: a server that is not there fails in a second, not a minute.
    server = None if served_url is None else ServedClient(
        served_url, read_model_config(model).vocab_size)
    engines = [LLM(model, dtype=dtype, device=device, block_size=block_size,
                   kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=offload is not None,
                   kv_offload=offload).engine
               for offload in dict.fromkeys([None, kv_offload])]
    try:
        measurements, runs = _measure_steps(engines, server, repeats)
    finally:
        for engine in engines:
            engine.shutdown()
    base, per_token, per_seq, per_pair, per_context = _fit(measurements)
    loads = {"host": _host_copy_s_per_byte(), "disk": _disk_read_s_per_byte(disk_dir)}
    loads["fs"] = loads["disk"]
    cost = CostModel(base, per_token, per_seq, loads, model=model or "SmolLM2-135M-Instruct",
                     machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {dtype}, KV "
                             f"{kv_cache_dtype}, "
                             f"device {device or 'default'}, kv_offload {kv_offload}",
                     prefill_s_per_pair=per_pair, decode_s_per_context_token=per_context)
    if kv_offload is not None:
        offload = OffloadConfig.from_extra_config(parse_kv_offload(kv_offload))
        per_block = model_kv(model, block_size, "bfloat16" if dtype == "auto" else dtype,
                             kv_cache_dtype=kv_cache_dtype)
        stored = {batch: repeats * stored_bytes(batch, offload, block_size,
                                                per_block.bytes_per_block) for batch in runs}
        cost = replace(cost, store_s_per_byte=store_costs(runs, stored, offload,
                                                          loads["host"]))
    if served_url is None:
        return Calibration(cost, [m.__dict__ for m in measurements])
    served = [ServedBatch(*batch, len(run.steps), batch[0] * batch[2],
                          (run.offload_s if kv_offload else run.plain_s) / repeats,
                          run.served_s / repeats) for batch, run in runs.items()]
    per_step, per_streamed = fit_served(served)
    cost = replace(cost, server_s_per_step=per_step, server_s_per_token=per_streamed,
                   machine=f"{cost.machine}, served at {served_url}")
    return Calibration(cost, [m.__dict__ for m in measurements],
                       [b.__dict__ for b in served])


def store_costs(runs: dict[tuple, BatchRuns], stored: dict[tuple, int], offload: OffloadConfig,
                host_copy_s_per_byte: float) -> dict[str, float]:
    """`store_s_per_byte` from the batches run with `offload`'s tiers, each storing
    `stored[batch]` bytes in all its runs: the seconds they took beyond the same batches in the
    engine alone, per byte stored. The stores run beside the steps and the next step waits for
    the copies, so whole batches are compared, not steps. Host memory is charged its copy cost
    of that, the secondary tiers share the rest."""
    extra = sum(run.offload_s - run.plain_s for run in runs.values())
    per_byte = max(0.0, extra) / max(sum(stored.values()), 1)
    kinds = [spec.type for spec in offload.secondary_tiers]
    if not kinds:
        return {"host": per_byte}
    host = min(per_byte, host_copy_s_per_byte)
    return {"host": host, **{kind: (per_byte - host) / len(kinds) for kind in kinds}}


def stored_bytes(batch: tuple[int, int, int], offload: OffloadConfig, block_size: int,
                 bytes_per_block: int) -> int:
    """The bytes of the full prompt chunks a calibration batch stores (its prompts are random:
    every chunk is new)."""
    num_seqs, prompt_tokens, _ = batch
    chunk_blocks = offload.blocks_per_chunk
    return num_seqs * (prompt_tokens // (block_size * chunk_blocks)) * chunk_blocks \
        * bytes_per_block


def calibration_batches(max_model_len: int) -> list[tuple[int, int, int]]:
    """BATCHES for a model of `max_model_len` tokens, without the ones cutting made repeats."""
    longest = max_model_len // 2
    batches: list[tuple[int, int, int]] = []
    for num_seqs, prompt_tokens, output_tokens in BATCHES:
        batch = (num_seqs, min(prompt_tokens, longest - output_tokens), output_tokens)
        if batch not in batches:
            batches.append(batch)
    return batches


def _measure_steps(engines: list, server: ServedClient | None,
                   repeats: int) -> tuple[list[Measurement], dict[tuple, BatchRuns]]:
    """Every batch `repeats` times in each engine (the first alone, the second with tiers) and
    served, one after the other. Of the first engine's steps that did the same work, the
    fastest (the others met the machine's other jobs)."""
    from kvtier.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    vocab = engines[0].model_config.vocab_size
    batches = calibration_batches(engines[0].max_model_len)
    for engine in engines:  # first-call costs are no step's
        _run_batch(engine, rng, vocab, (1, 32, 2), SamplingParams)
    fastest: dict[tuple[int, int, int, int], float] = {}
    runs: dict[tuple, BatchRuns] = {}
    for _ in range(repeats):
        for batch in batches:
            steps = _run_batch(engines[0], rng, vocab, batch, SamplingParams)
            run = runs.setdefault(batch, BatchRuns(steps))
            run.steps = steps
            run.plain_s += sum(step.step_s for step in steps)
            for step in steps:
                work = (step.prefill_tokens, step.decode_seqs, step.prefill_pairs,
                        step.decode_context)
                fastest[work] = min(step.step_s, fastest.get(work, step.step_s))
            if len(engines) > 1:
                offload_steps = _run_batch(engines[1], rng, vocab, batch, SamplingParams)
                run.offload_s += sum(step.step_s for step in offload_steps)
                time.sleep(_SETTLE_S)
            if server is not None:
                run.served_s += server.serve(rng, batch)
                time.sleep(_SETTLE_S)
    return [Measurement(tokens, seqs, seconds, pairs, context)
            for (tokens, seqs, pairs, context), seconds in fastest.items()], runs


def _run_batch(engine, rng, vocab: int, batch: tuple[int, int, int],
               sampling_params) -> list[Measurement]:
    num_seqs, prompt_tokens, output_tokens = batch
    params = sampling_params(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for _ in range(num_seqs):
        engine.add_request(f"calibrate-{rng.integers(2**62)}",
                           rng.integers(0, vocab, prompt_tokens).tolist(), params)
    steps = []
    while engine.has_unfinished_requests():
        before = [(r, r.num_computed_tokens) for r in engine.scheduler.requests.values()]
        started = time.perf_counter()
        engine.step()
        steps.append(_step_measurement(before, time.perf_counter() - started))
    return [step for step in steps if step.prefill_tokens or step.decode_seqs]


def _step_measurement(before: list, step_s: float) -> Measurement:
    """What the step computed, from each request's computed tokens before it and now."""
    tokens = seqs = pairs = context = 0
    for request, num_computed in before:
        num_new = request.num_computed_tokens - num_computed
        if num_new <= 0:
            continue
        if num_computed < request.num_prompt_tokens:
            tokens += num_new
            pairs += prefill_pairs(num_new, num_computed)
        else:  # one new token, attending to everything before it and itself
            seqs += 1
            context += num_computed + 1
    return Measurement(tokens, seqs, step_s, pairs, context)


def _fit(measurements: list[Measurement]) -> tuple[float, ...]:
    """The step costs: nonnegative_fit of step seconds on Measurement.features."""
    seconds = np.array([m.step_s for m in measurements])
    return nonnegative_fit(np.array([m.features() for m in measurements]), seconds, seconds)


def _host_copy_s_per_byte() -> float:
    source = np.ones(_COPY_BYTES, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in before timing
    started = time.perf_counter()
    for _ in range(4):
        np.copyto(target, source)
    return (time.perf_counter() - started) / (4 * _COPY_BYTES)


def _disk_read_s_per_byte(directory: str | None) -> float:
    payload = np.random.default_rng(0).integers(0, 256, _COPY_BYTES, dtype=np.uint8).tobytes()
    with tempfile.NamedTemporaryFile(dir=directory, prefix="kvtier-calibrate-") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
        if hasattr(os, "posix_fadvise"):
            # Read from the disk, not from the page cache the write just filled.
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        with open(handle.name, "rb", buffering=0) as reader:
            while reader.read(8 * 1024 * 1024):
                pass
        return (time.perf_counter() - started) / _COPY_BYTES
