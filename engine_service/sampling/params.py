"""SamplingParams: what a request asks of generation. Names and defaults follow vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    The engine works in token ids: EOS, ``stop_token_ids``, ``max_tokens`` and ``min_tokens`` are
    enforced in the engine; ``stop`` strings are applied where text is produced (the offline
    ``LLM`` and the gateway), which cancel the request when one matches.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the chosen token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
