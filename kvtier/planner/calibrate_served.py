"""What serving adds to the engine's steps, measured against a running `kvtier serve`.

The engine's steps alone (calibrate.py) are not what a client sees: the server's HTTP loop, the
output streams and the client itself share the machine with the engine thread. So each
calibration batch is sent again, as streaming completions all at once, to a server of the same
model, block size, scheduler limits and tiers, and timed from the first request sent to the
last stream closed. What that takes beyond the engine's own steps for the same batch (the
fitted step costs over the steps the batch took in the engine, and its stores) is fitted as
`server_s_per_step` x steps + `server_s_per_token` x tokens streamed, every coefficient >= 0.
The engine's time for a batch counts its stores (store_s_per_byte) when the server has tiers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from kvtier.planner.calibrate import nonnegative_fit
from kvtier.planner.cost_model import CostModel

_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServedBatch:
    """One calibration batch: as served (`served_s`), and what the engine did for it alone:
    `num_steps` steps whose fitted costs sum to `engine_s`, streaming `num_tokens` tokens."""

    num_seqs: int
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    num_tokens: int
    engine_s: float
    served_s: float


def measure_served(url: str, batches: dict[tuple[int, int, int], list], cost: CostModel,
                   vocab_size: int, store_s: dict[tuple[int, int, int], float],
                   repeats: int = 1) -> list[ServedBatch]:
    """Each batch (num_seqs, prompt tokens, output tokens) of `batches`, whose value is the
    engine's steps for it (calibrate.Measurement) and `store_s` its stores' seconds, served by
    the server at `url`."""
    return asyncio.run(_measure(url, batches, cost, vocab_size, store_s, repeats))


async def _measure(url: str, batches: dict[tuple[int, int, int], list], cost: CostModel,
                   vocab_size: int, store_s: dict[tuple[int, int, int], float],
                   repeats: int) -> list[ServedBatch]:
    rng = np.random.default_rng(1)
    limits = httpx.Limits(max_connections=max(b[0] for b in batches) + 1)
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=_REQUEST_TIMEOUT_S) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await _serve_batch(http, model, rng, vocab_size, (1, 16, 2))  # first-call costs
        fastest: dict[tuple[int, int, int], float] = {}
        for _ in range(repeats):
            for batch in batches:
                seconds = await _serve_batch(http, model, rng, vocab_size, batch)
                fastest[batch] = min(seconds, fastest.get(batch, seconds))
    results = []
    for batch, steps in batches.items():
        engine_s = store_s[batch] + sum(cost.step_s(s.prefill_tokens, s.decode_seqs,
                                                    s.prefill_pairs, s.decode_context)
                                        for s in steps)
        results.append(ServedBatch(*batch, len(steps), batch[0] * batch[2], engine_s,
                                   fastest[batch]))
    return results


async def _serve_batch(http: httpx.AsyncClient, model: str, rng: np.random.Generator,
                       vocab_size: int, batch: tuple[int, int, int]) -> float:
    num_seqs, prompt_tokens, output_tokens = batch
    prompts = [rng.integers(0, vocab_size, prompt_tokens).tolist() for _ in range(num_seqs)]
    started = time.perf_counter()
    await asyncio.gather(*(_stream(http, model, prompt, output_tokens) for prompt in prompts))
    return time.perf_counter() - started


async def _stream(http: httpx.AsyncClient, model: str, prompt: list[int],
                  output_tokens: int) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"the server answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"error"' in line:
                raise RuntimeError(f"the server's stream failed: {line[:200]}")


def fit_served(batches: list[ServedBatch]) -> tuple[float, float]:
    """(server_s_per_step, server_s_per_token): the least-squares fit, each >= 0, of what the
    batches took served beyond their engine steps, relative to each batch's served time."""
    features = np.array([[b.num_steps, b.num_tokens] for b in batches], dtype=float)
    extra = np.array([b.served_s - b.engine_s for b in batches])
    served = np.array([b.served_s for b in batches])
    per_step, per_token = nonnegative_fit(features, extra, served)
    return per_step, per_token
