"""When a request ends: its stop conditions, checked on each token the scheduler appends."""

from __future__ import annotations

from batchserve.request import FinishReason, Request


def stop_reason(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Why `request` ends at `token_id`, just appended (EOS or a stop token once min_tokens are out, max_tokens,
    the context), or None; a stop token is recorded as the request's stop_reason."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_id_set:
            request.stop_reason = token_id
            return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
