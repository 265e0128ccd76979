"""The engine's stopping rules, applied after each sampled token. Text-level stop strings live in
``sluice.text`` because the engine never sees text."""

from __future__ import annotations

from engine_service.core.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its last token ends it; return whether it finished.

    EOS and stop tokens only count once ``min_tokens`` is reached (the sampler also masks them
    until then, so this is a second line of defence, not the mechanism).
    """
    params = request.sampling_params
    num_out = request.num_output_tokens
    if num_out == 0:
        return False
    last = request.output_token_ids[-1]
    if request.structured_error is not None:
        # the request's constraint failed, not the engine: the client's error (400), this request alone
        request.finish(FinishReason.ERROR, error=request.structured_error, error_code="invalid_request")
        return True
    if num_out >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            request.finish(FinishReason.STOP)
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.finish(FinishReason.STOP, stop_reason=last)
            return True
    if request.structured_done:  # the grammar is complete: it allows nothing but EOS from here
        request.finish(FinishReason.STOP)
        return True
    if params.max_tokens is not None and num_out >= params.max_tokens:
        request.finish(FinishReason.LENGTH)
        return True
    if request.num_tokens >= max_model_len:
        request.finish(FinishReason.LENGTH)
        return True
    return False
