"""When a request stops generating, judged from the tokens it has so far.

Stop strings need detokenized text, so the engine checks those and finishes the request through
`Scheduler.finish_requests`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.kv import RequestStatus

if TYPE_CHECKING:
    from kvtier.kv import Request


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request has reached after its newest token, or None.

    Sets `request.stop_reason` to the stop token id when one ended it. A stop token that is also
    the last token allowed by max_tokens reports "stop": the model chose to end there.
    """
    params = request.sampling_params
    min_tokens = 0 if params is None else params.min_tokens
    if request.num_output_tokens >= min_tokens and request.output_token_ids:
        last = request.output_token_ids[-1]
        ignore_eos = params is not None and params.ignore_eos
        if not ignore_eos and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if params is not None and last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
