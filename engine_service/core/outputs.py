"""What the engine hands out: per-step deltas (for streaming services) and vLLM-shaped results."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.core.request import FinishReason, Logprob


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class EngineOutput:
    """One request's news from one engine step: new tokens, and a finish when it ended."""

    request_id: str  # the id given to add_request
    new_token_ids: list[int]
    index: int = 0  # which of the request's n completions
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    error: str | None = None
    error_code: str | None = None  # the contract's short error name for ``error`` (None: internal)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # sent once, with the first tokens
    metrics: RequestMetrics | None = None  # the completion's timings, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
