"""Stop strings over streamed text: release text as soon as no stop string can still cover it.

The detokenizer hands over text as it becomes final. This buffer runs it through an
Aho-Corasick automaton of the request's stop strings, one transition per character, so the
cost of a step is proportional to the new text whatever the stop list. The automaton's state
is the longest suffix of the text that is still the start of some stop string: exactly the
tail to hold back, so a stop string split across tokens is caught and no part of it is ever
streamed.

The first stop string to complete ends the text (the earliest end; of several ending at the
same character, the longest): the point where generation would have stopped had it been
checked after every character, so the result does not depend on how the text arrived in
pieces. The text ends before the stop string (or after it, with
``include_stop_str_in_output``).
"""

from __future__ import annotations

import functools
from collections import deque


class StopAutomaton:
    """Aho-Corasick automaton over a list of stop strings (immutable once built).

    Node 0 is the root. ``depth[s]`` is the length of the prefix node ``s`` stands for;
    ``ends[s]`` is the length of the longest stop string ending at that node (0: none).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = nxt
            ends[node] = max(ends[node], len(stop))
        fail = [0] * len(goto)
        queue = deque(goto[0].values())  # the root's children fail to the root
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                # A stop string ending here is this node's or one ending at its fail node.
                ends[child] = ends[child] or ends[fail[child]]
                queue.append(child)
        self.goto, self.fail, self.depth, self.ends = goto, fail, depth, ends

    def advance(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@functools.lru_cache(maxsize=32)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops``, shared by every request with the same list (``n``
    siblings, repeated requests); callers off the engine thread may build it ahead. The
    largest list the engine accepts by default (32 strings of 256 characters) builds in tens
    of milliseconds and takes about 2 MB, so the cache holds at most some 64 MB."""
    return StopAutomaton(stops)


class StopStringBuffer:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop = include_stop
        self.automaton = stop_automaton(tuple(self.stops)) if self.stops else None
        self.state = 0
        self.text = ""  # all final text seen (truncated at a match)
        self.sent = 0  # characters of ``text`` released so far
        self.matched: str | None = None

    def push(self, new_text: str, check: bool = True) -> str:
        """Add final text; returns what may be released now. After a match, returns ''.

        ``check=False`` (up to ``min_tokens``) does not stop: stop strings do not count yet, as
        in vLLM. The tail that may still become a stop string is held back all the same, so
        one that begins there and completes later is cut without any of it released.
        """
        if self.matched is not None:
            return ""
        old_len = len(self.text)
        self.text += new_text
        ac = self.automaton
        if ac is None:
            return self._release(len(self.text))
        state, ends = self.state, ac.ends
        for i, ch in enumerate(new_text):
            state = ac.advance(state, ch)
            if check and ends[state]:
                end = old_len + i + 1
                length = ends[state]
                self.matched = self.text[end - length : end]
                self.text = self.text[: end if self.include_stop else end - length]
                return self._release(len(self.text))
        self.state = state
        return self._release(len(self.text) - ac.depth[state])

    def flush(self) -> str:
        """Release everything held (the request ended for another reason)."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out
