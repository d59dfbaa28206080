"""Stop strings over streamed text: release text as soon as no stop string can still cover it.

The detokenizer hands over text as it becomes final. This buffer searches it for the request's
stop strings and holds back the shortest tail that could still be the start of one (never more
than ``len(longest stop) - 1`` characters), so a stop string split across tokens is caught and
no part of it is ever streamed. On a match, the text ends before the stop string (or after it,
with ``include_stop_str_in_output``).
"""

from __future__ import annotations


class StopStringBuffer:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop = include_stop
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all final text seen (truncated at a match)
        self.sent = 0  # characters of ``text`` released so far
        self.matched: str | None = None

    def push(self, new_text: str, check: bool = True) -> str:
        """Add final text; returns what may be released now. After a match, returns ''.

        ``check=False`` (before ``min_tokens``) releases without searching: stop strings do
        not count yet, as in vLLM.
        """
        if self.matched is not None:
            return ""
        old_len = len(self.text)
        self.text += new_text
        if not self.stops or not check:
            return self._release(len(self.text))
        # A match must end inside the new text; it may start up to longest-1 chars before it.
        start = max(0, old_len - self.longest + 1)
        best: tuple[int, int] | None = None  # (start index, -length): earliest, then longest
        for stop in self.stops:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or (i, -len(stop)) < best):
                best = (i, -len(stop))
        if best is not None:
            i, neg_len = best
            self.matched = self.text[i : i - neg_len]
            end = i - neg_len if self.include_stop else i
            self.text = self.text[:end]
            return self._release(end)
        return self._release(len(self.text) - self._partial_tail())

    def flush(self) -> str:
        """Release everything held (the request ended for another reason)."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _partial_tail(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self.text
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out
