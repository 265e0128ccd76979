"""A request's state inside one engine: its tokens, its KV blocks, its lifecycle and its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine_service.core.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id (or, at the text layer, a stop string)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the operator
    ERROR = "error"  # refused or failed inside the engine


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(eq=False)
class Request:
    """One sequence the scheduler runs. ``n > 1`` is expanded into several Requests before this."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Who it is for (``sluice.wire.tenants``; "": the default tenant) and its fair-share weight
    # (``engine_service.core.fair_share``), both checked before it reaches the scheduler.
    tenant: str = ""
    tenant_weight: int = 1
    # Lifecycle
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    error: str | None = None
    error_code: str | None = None  # the contract's short error name (None: internal)
    # Tokens: prompt followed by the generated ones; ``num_computed_tokens`` of them have KV in cache.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    # KV blocks, in order; owned and mutated by the scheduler's block pool.
    block_ids: list[int] = field(default_factory=list)
    # Sampling state
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Structured outputs (set by the engine's grammar matcher): the grammar is complete, or the
    # sampled token broke it; the stopping rules end the request on either.
    structured_done: bool = False
    structured_error: str | None = None
    # Timings (time.monotonic) and counters
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # stamped by the scheduler, with its clock
    finished_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self._all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    # --- tokens ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only view: mutate through ``append_output_token``."""
        return self._all_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # --- lifecycle ---
    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, *, stop_reason: int | None = None, error: str | None = None,
               error_code: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.error_code = error_code
        self.finished_time = time.monotonic()

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time
