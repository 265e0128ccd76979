"""The limits on a ``GenerateRequest``, written once: the gateway refuses what breaks them before
queueing (with a friendlier, field-by-field message), the engine checks them again on what it reads
from the queue, because anything that can XADD can put an entry there.

``check_request`` works on the wire message alone (no torch, no engine): it returns ``None`` or
``(code, reason)`` (``invalid_request``, or ``context_length_exceeded`` for a prompt that does not
fit), which the engine sends as an error event and acknowledges: never a stall.
"""

from __future__ import annotations

from sluice.wire import contract
from sluice.wire.messages_pb2 import GenerateRequest

MAX_N = 16  # completions per request
MAX_LOGPROBS = 20  # alternatives per position (logprobs and prompt_logprobs)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_REQUEST_ID_LEN = 256


def check_request(
    req: GenerateRequest, *, vocab_size: int | None, max_model_len: int | None
) -> tuple[str, str] | None:
    """``(error code, why)`` when ``req`` must be refused, else None. O(prompt + stop ids + bias)."""
    problem = _invalid(req, vocab_size)
    if problem is not None:
        return contract.ERR_INVALID_REQUEST, problem
    p = req.params
    prompt_len = len(req.prompt_token_ids)
    if max_model_len is not None:
        if prompt_len >= max_model_len:
            return contract.ERR_CONTEXT_LENGTH, (
                f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}"
            )
        if p.HasField("max_tokens") and prompt_len + p.max_tokens > max_model_len:
            return contract.ERR_CONTEXT_LENGTH, (
                f"the prompt ({prompt_len} tokens) plus max_tokens ({p.max_tokens}) exceeds this model's "
                f"context of {max_model_len} tokens"
            )
    return None


def _invalid(req: GenerateRequest, vocab_size: int | None) -> str | None:
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id is longer than {MAX_REQUEST_ID_LEN} characters"
    p = req.params
    n = p.n if p.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        return f"n must be in [1, {MAX_N}], got {n}"
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and not 0 <= getattr(p, name) <= MAX_LOGPROBS:
            return f"{name} must be in [0, {MAX_LOGPROBS}], got {getattr(p, name)}"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(p.logit_bias)}"
    for value in p.logit_bias.values():
        if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:  # NaN fails too
            return f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {value}"
    if not req.prompt_token_ids:
        return "the prompt is empty"
    if p.HasField("max_tokens") and p.max_tokens < 1:
        return f"max_tokens must be at least 1, got {p.max_tokens}"
    if p.min_tokens < 0 or (p.HasField("max_tokens") and p.min_tokens > p.max_tokens):
        return f"min_tokens must be in [0, max_tokens], got {p.min_tokens}"
    if vocab_size is not None:
        for what, ids in (("prompt", req.prompt_token_ids), ("stop_token_ids", p.stop_token_ids),
                          ("logit_bias", p.logit_bias.keys())):
            for t in ids:
                if not 0 <= t < vocab_size:
                    return f"{what} token id {t} is outside the vocabulary [0, {vocab_size})"
    return None
