"""`kvtier plan calibrate`: measure this machine with a model and fit the planner's cost model.

Prefills of a few sizes and decodes of a few batch sizes and context lengths run through `LLM`
(prefix caching off, random token ids, greedy, no early stop); one least-squares fit of seconds
per step against (1, prefill tokens, decoding sequences, prefill attention pairs, context tokens
decoded against) gives the step costs, each row weighted by its own time so that a 20 ms decode
step is fitted as closely as a 2 s prefill. Host loads are timed as a copy of a buffer in memory,
disk loads as a read of a file written, synced and dropped from the page cache first (where the
OS allows), so both are per-byte costs of this machine.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from kvtier.planner.cost_model import CostModel, prefill_pairs

PREFILL_SIZES = (128, 512, 1024, 2048)
# (sequences, prompt tokens of each): the batch sizes give the per-sequence cost, the long
# prompts the cost of the context a decoding sequence reads.
DECODE_BATCHES = ((1, 16), (4, 16), (16, 16), (4, 1024))
DECODE_STEPS = 16
_COPY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Measurement:
    """One timed configuration: seconds of one step that prefills `prefill_tokens` (from an empty
    context) or decodes `decode_seqs` sequences of `decode_context` tokens each (a mean)."""

    prefill_tokens: int
    decode_seqs: int
    step_s: float
    decode_context: float = 0.0

    def features(self) -> list[float]:
        """The step's (1, prefill tokens, decoding seqs, attention pairs, context decoded)."""
        return [1.0, self.prefill_tokens, self.decode_seqs,
                prefill_pairs(self.prefill_tokens, 0), self.decode_seqs * self.decode_context]


def calibrate(model: str | None, dtype: str = "auto", device: str | None = None,
              disk_dir: str | None = None, repeats: int = 2) -> tuple[CostModel, list[dict]]:
    """Measure and fit; returns the cost model and the measurements it came from."""
    from kvtier.engine.llm import LLM

    llm = LLM(model, dtype=dtype, device=device, enable_prefix_caching=False)
    try:
        vocab = llm.engine.model_config.vocab_size
        measurements = _measure_steps(llm, vocab, repeats)
    finally:
        llm.engine.shutdown()
    base, per_token, per_seq, per_pair, per_context = _fit(measurements)
    loads = {"host": _host_copy_s_per_byte(), "disk": _disk_read_s_per_byte(disk_dir)}
    loads["fs"] = loads["disk"]
    cost = CostModel(base, per_token, per_seq, loads, model=model or "SmolLM2-135M-Instruct",
                     machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {dtype}, "
                             f"device {device or 'default'}",
                     prefill_s_per_pair=per_pair, decode_s_per_context_token=per_context)
    return cost, [m.__dict__ for m in measurements]


def _measure_steps(llm, vocab: int, repeats: int) -> list[Measurement]:
    from kvtier.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)

    def prompts(count: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(0, vocab, length).tolist()}
                for _ in range(count)]

    llm.generate(prompts(1, 32), one)  # warm-up: first-call costs are not a step's
    measurements = []
    # A small model's context may be shorter than the largest size.
    longest = llm.engine.max_model_len // 2
    for size in sorted({min(size, longest) for size in PREFILL_SIZES}):
        seconds = min(_timed(llm, prompts(1, size), one) for _ in range(repeats))
        measurements.append(Measurement(size, 0, seconds))
    for batch, prompt_tokens in DECODE_BATCHES:
        if prompt_tokens + DECODE_STEPS > longest:
            continue
        batch_prompts = prompts(batch, prompt_tokens)
        first = min(_timed(llm, batch_prompts, one) for _ in range(repeats))
        whole = min(_timed(llm, batch_prompts, many) for _ in range(repeats))
        # Steps 2..DECODE_STEPS attend to prompt + 1 .. prompt + DECODE_STEPS - 1 tokens.
        context = prompt_tokens + DECODE_STEPS / 2
        measurements.append(Measurement(0, batch, max(0.0, whole - first) / (DECODE_STEPS - 1),
                                        context))
    return measurements


def _timed(llm, prompts: list[dict], params) -> float:
    started = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started


def _fit(measurements: list[Measurement]) -> tuple[float, ...]:
    """Least squares of step seconds on Measurement.features, relative to each step's time,
    every coefficient >= 0: one that comes out negative is held at 0 and the others fitted
    again. A coefficient the measurements cannot tell from the ones before it (a model too
    short for the long-context decode) is held at 0 too."""
    # Divided by its own time, each row counts by its relative error.
    weights = np.array([1.0 / max(m.step_s, 1e-9) for m in measurements])
    rows = np.array([m.features() for m in measurements]) * weights[:, None]
    seconds = np.array([m.step_s for m in measurements]) * weights
    free: list[int] = []
    for column in range(rows.shape[1]):
        if np.linalg.matrix_rank(rows[:, free + [column]]) > len(free):
            free.append(column)
    coefficients = np.zeros(rows.shape[1])
    while free:
        fitted, *_ = np.linalg.lstsq(rows[:, free], seconds, rcond=None)
        coefficients[:] = 0.0
        coefficients[free] = fitted
        negative = [column for column, value in zip(free, fitted) if value < 0]
        if not negative:
            break
        free = [column for column in free if column not in negative]
    return tuple(float(c) for c in coefficients)


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
