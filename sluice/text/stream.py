"""One completion's text as its tokens arrive: the incremental detokenizer and the stop strings,
together. The one implementation of "detokenize + stop" that the gateway
(``gateway.generation.Choice``) and the offline API (``engine_service.llm``) share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sluice.text.detokenizer import IncrementalDetokenizer
from sluice.text.stop import StopMatcher, StopResult


class TextStream:
    """Feed token ids with :meth:`add`; each call returns the text that may be shown now (never a
    split character, never text past or inside a pending stop string) and whether a stop string
    ended the completion. When the engine ends the completion, :meth:`finish` releases what was
    held back. ``text`` accumulates everything returned."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Iterable[int], *, stop: Iterable[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids),
                                                  skip_special_tokens=skip_special_tokens)
        self.matcher = StopMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
        self.text = ""
        self.stop: str | None = None  # the stop string that ended the completion

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def _emit(self, res: StopResult) -> StopResult:
        self.text += res.text
        if res.stopped and self.stop is None:
            self.stop = res.stop
        return res

    def add(self, token_id: int) -> StopResult:
        return self._emit(self.matcher.feed(self.detokenizer.add(token_id)))

    def add_many(self, token_ids: Iterable[int]) -> StopResult:
        return self._emit(self.matcher.feed(self.detokenizer.add_many(list(token_ids))))

    def finish(self) -> StopResult:
        """The engine ended the completion: flush the detokenizer, then (unless that completed a
        stop string) release the text held back as a possible stop-string prefix."""
        res = self.matcher.feed(self.detokenizer.flush())
        if not res.stopped:
            res = StopResult(res.text + self.matcher.flush())
        return self._emit(res)
