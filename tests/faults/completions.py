"""What the fault tests ask of a running `kvtier serve`."""

from __future__ import annotations

import httpx


def greedy_completion(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(generated token ids, cached prompt tokens) of a greedy completion of `prompt`; the
    server must run with --enable-prompt-tokens-details."""
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return (body["choices"][0]["token_ids"],
            body["usage"]["prompt_tokens_details"]["cached_tokens"])
