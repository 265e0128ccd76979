"""SamplingParams: what a request asks of generation. Names and defaults follow vLLM's."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from sluice.structured import StructuredOutputsParams
from sluice.wire import limits

# Below this temperature a request is sampled greedily (vLLM uses the same threshold).
SAMPLING_EPS = 1e-5
# The fields a model's generation_config.json may default (vLLM's list), with the neutral default
# used when neither the request nor the model sets them: ``sluice.wire.limits.MODEL_DEFAULTS``.
MODEL_DEFAULTABLE: tuple[tuple[str, float | int], ...] = tuple(limits.MODEL_DEFAULTS.items())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    The engine works in token ids: EOS, ``stop_token_ids``, ``max_tokens`` and ``min_tokens`` are
    enforced in the engine; ``stop`` strings are applied where text is produced (the offline
    ``LLM`` and the gateway), which cancel the request when one matches.

    Every value is checked when the object is built: an out-of-range one raises ``ValueError``
    whose message starts with the parameter's name. Checks that need the vocabulary
    (``logit_bias`` and ``stop_token_ids`` ids) live in :meth:`verify`.
    """

    n: int = 1
    # None (unset): the model's generation_config.json value when the engine runs with
    # generation_config="auto" (the default), else the neutral default in MODEL_DEFAULTABLE.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 (or 0) disables
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
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
    # Constrained decoding: a JSON schema, any JSON object, a regex, a choice list or a grammar
    # (vLLM's name; a dict with one of those keys is accepted).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Unset model-defaultable fields take the neutral default now (so every reader sees a
        # number) and are remembered, so that with_model_defaults can still fill them.
        self._unset = frozenset(n for n, _ in MODEL_DEFAULTABLE if getattr(self, n) is None)
        for name, neutral in MODEL_DEFAULTABLE:
            if getattr(self, name) is None:
                setattr(self, name, neutral)
        # Normalise the containers first (JSON gives logit_bias keys as strings, stop as a str).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token_id = int(key)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
                if isinstance(key, float) and key != token_id:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                bias[token_id] = value
            self.logit_bias = bias
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0 and _is_int(self.top_k):  # vLLM: 0 disables, as -1
            self.top_k = -1
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        """The bounds of ``sluice.wire.limits`` (the same the gateway and the engine's re-check
        apply), after the checks of shape only this side needs."""
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logit_bias is not None:
            for token_id in self.logit_bias:
                if token_id < 0:
                    raise ValueError(f"logit_bias token id must be non-negative, got {token_id}")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids is not None:
            for token_id in self.stop_token_ids:
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")
        problem = limits.check_sampling({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problem is not None:
            raise ValueError(problem.message)

    def verify(self, vocab_size: int) -> None:
        """The checks that need the model: token ids must lie inside the vocabulary."""
        for param, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids or ())):
            problem = limits.check_token_ids(param, ids, vocab_size)
            if problem is not None:
                raise ValueError(problem.message)

    # --- derived views ---
    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def decodes_by_argmax(self, num_output_tokens: int) -> bool:
        """Whether the token after ``num_output_tokens`` outputs is the argmax of the model's raw
        logits and nothing else is asked of them: greedy, no logit bias, no penalty, no logprobs, no
        structured output, and ``min_tokens`` reached (no stop token masked). The sampler's
        metadata (``engine_service.sampling.metadata``) then leaves the row greedy and unprocessed,
        so several such steps may run without it (``num_scheduler_steps``)."""
        return (self.temperature < SAMPLING_EPS and not self.logit_bias and self.logprobs is None
                and self.structured_outputs is None and num_output_tokens >= self.min_tokens
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.repetition_penalty == 1.0)

    @property
    def sampling_type(self) -> str:
        """``"greedy"``, ``"seeded"`` or ``"random"``."""
        if self.greedy:
            return "greedy"
        return "random" if self.seed is None else "seeded"

    # --- model defaults ---
    @property
    def unset_fields(self) -> frozenset[str]:
        """The model-defaultable fields the caller left unset."""
        return self._unset

    def with_model_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A copy in which the fields the caller left unset take ``defaults`` (the model's
        ``generation_config.json`` values, ``sluice.wire.card.sampling_defaults``); self when none apply."""
        changes = {k: v for k, v in defaults.items() if k in self._unset}
        if not changes:
            return self
        out = self.replace(**changes)
        out._unset = self._unset - set(changes)
        return out

    # --- copies ---
    def clone(self) -> SamplingParams:
        """A deep copy (lists and dicts are not shared)."""
        return copy.deepcopy(self)

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        base = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in self._unset:  # still unset in the copy unless changed
            base[name] = None
        base.update(changes)
        return SamplingParams(**base)

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of an ``n > 1`` request, as vLLM builds them:
        ``n=1`` and, when seeded, ``seed + index`` so the completions differ but stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return self.replace(n=1, seed=seed)
