"""Stop strings, matched on streamed text across token boundaries.

The engine works in token ids only; a stop string is found where text is produced. Text arrives in
deltas, so a stop string may straddle two (or many) deltas: :class:`StopMatcher` holds back the
longest tail of the pending text that could still grow into a stop string, emits the rest, and on a
match emits the text before the stop (plus the stop itself with ``include_stop_str_in_output``) and
reports it. Nothing after a match is ever emitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that matched, if one did

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopMatcher:
    def __init__(self, stops: Iterable[str] | None, *, include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.include = include_stop_str_in_output
        self._pending = ""
        self.stopped: str | None = None

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _held_tail(self, text: str) -> int:
        """Length of the longest proper suffix of ``text`` that is a prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> StopResult:
        """Add a text delta; return what may be emitted and whether a stop string matched."""
        if self.stopped is not None:
            return StopResult("", self.stopped)
        if not self.stops:
            return StopResult(delta)
        text = self._pending + delta
        match_pos, match = -1, None
        for stop in self.stops:
            pos = text.find(stop)
            if pos != -1 and (match is None or pos < match_pos):
                match_pos, match = pos, stop
        if match is not None:
            self.stopped = match
            self._pending = ""
            end = match_pos + (len(match) if self.include else 0)
            return StopResult(text[:end], match)
        hold = self._held_tail(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return StopResult(text[: len(text) - hold])

    def flush(self) -> str:
        """At the end of the output: release text held back as a possible stop prefix."""
        if self.stopped is not None:
            return ""
        out, self._pending = self._pending, ""
        return out
