"""What serving adds to the engine's steps, measured against a running `kvtier serve`.

The engine's steps alone (calibrate.py) are not what a client sees: the server's HTTP loop, the
output streams and the client itself share the machine with the engine thread. So each
calibration batch, right after it ran in the engine with the server's tiers (or alone, if it
has none), is sent as streaming completions all at once to a server of the same model, block
size, scheduler limits and tiers, and timed from the first request sent to the last stream
closed. What that takes beyond the batch in the engine is fitted as `server_s_per_step` x the
batch's steps + `server_s_per_token` x its tokens streamed, every coefficient >= 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from kvtier.planner.fit import nonnegative_fit

_REQUEST_TIMEOUT_S = 600.0
# A server that does not answer its model list within this is not the one to calibrate with.
_CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServedBatch:
    """One calibration batch: as served (`served_s`, the mean of its runs), and in the engine
    right before (`engine_s`, with the server's tiers): `num_steps` steps streaming
    `num_tokens` tokens."""

    num_seqs: int
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    num_tokens: int
    engine_s: float
    served_s: float


class ServedClient:
    """Serves calibration batches on the `kvtier serve` at `url` and times them."""

    def __init__(self, url: str, vocab_size: int) -> None:
        """ValueError naming --served-url when no server answers there."""
        self.url = url.rstrip("/")
        self.vocab_size = vocab_size
        try:
            response = httpx.get(f"{self.url}/v1/models", timeout=_CONNECT_TIMEOUT_S)
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, LookupError) as error:
            raise ValueError(f"--served-url {url}: no `kvtier serve` answered its model list "
                             f"({type(error).__name__}: {error}); start one there, or leave "
                             "--served-url out") from None
        self.serve(np.random.default_rng(1), (1, 16, 2))  # first-call costs

    def serve(self, rng: np.random.Generator, batch: tuple[int, int, int]) -> float:
        """Seconds from sending `batch`'s (num_seqs, prompt tokens, output tokens) random
        prompts at once to the end of the last stream."""
        num_seqs, prompt_tokens, output_tokens = batch
        prompts = [rng.integers(0, self.vocab_size, prompt_tokens).tolist()
                   for _ in range(num_seqs)]
        return asyncio.run(self._serve(prompts, output_tokens))

    async def _serve(self, prompts: list[list[int]], output_tokens: int) -> float:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(base_url=self.url, limits=limits,
                                     timeout=_REQUEST_TIMEOUT_S) as http:
            started = time.perf_counter()
            await asyncio.gather(*(_stream(http, self.model, prompt, output_tokens)
                                   for prompt in prompts))
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
