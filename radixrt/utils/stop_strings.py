"""Stop strings found in text that grows piece by piece, at O(new text) per piece.

Checking every stop string against a decoded tail after each token cost
O(stop strings x tail) per token: 30k stop strings slowed every request on the
server 8x. `StopStrings` is an Aho-Corasick automaton over characters, built
once per list (O(total characters)); a `StopScan` feeds it only the text new
since the last step, so each character costs amortized O(1) whatever the number
of strings. The automaton's state also says how much of the text's end could
still grow into a stop string: what a stream holds back.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence


class StopStrings:
    """The automaton of one list of stop strings; immutable, so requests with the same list share it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._goto: list[dict[str, int]] = [{}]  # trie edges; node 0 is the root (the empty string)
        depth, own = [0], [-1]  # a node's length; the stop string that is exactly the node (-1: none)
        for i, s in enumerate(self.stops):
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    depth.append(depth[node] + 1)
                    own.append(-1)
                node = nxt
            own[node] = i if own[node] < 0 else own[node]
        self._link_failures(depth, own)

    def _link_failures(self, depth: list[int], own: list[int]) -> None:
        """fail: a node's longest proper suffix in the trie; match: the longest stop string that
        ends at it (-1: none); held: the length of its longest suffix that is a proper prefix of a
        stop string (a node with children is one)."""
        n = len(self._goto)
        self._fail, self._match, self._held = [0] * n, own[:], [0] * n
        queue = deque(self._goto[0].values())
        for v in queue:  # depth 1: fail to the root
            self._held[v] = 1 if self._goto[v] else 0
        while queue:  # breadth first: a node's fail link is shallower, so done before it
            u = queue.popleft()
            for ch, v in self._goto[u].items():
                f = self._fail[u]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[v] = self._goto[f].get(ch, 0)
                fv = self._fail[v]
                if self._match[v] < 0:
                    self._match[v] = self._match[fv]
                self._held[v] = depth[v] if self._goto[v] else self._held[fv]
                queue.append(v)

    def first_start(self, text: str) -> int | None:
        """Where the earliest stop string in text starts (None: none); O(text)."""
        scan = StopScan(self)
        for k in range(0, len(text), 4096):  # stop once no later match can start earlier
            scan.feed(text[k : k + 4096])
            if scan.first is not None and scan.pos >= scan.first + self.longest:
                break
        return scan.first

    def held_after(self, text: str) -> int:
        """Characters at the end of text that are a proper prefix of a stop string (as many as can be)."""
        scan = StopScan(self)
        scan.feed(text[-self.longest :] if self.longest else "")  # a suffix longer than every string cannot count
        return scan.held


class StopScan:
    """The scan of one growing text: feed it each new piece in order."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.node = 0
        self.pos = 0  # characters fed so far
        self.first: int | None = None  # where the earliest stop string found so far starts

    def feed(self, piece: str) -> str | None:
        """Scan the next piece of the text; the first stop string that ends in it (None: none)."""
        a, node, found = self.stops, self.node, None
        goto, fail, match = a._goto, a._fail, a._match
        for ch in piece:
            while node and ch not in goto[node]:  # the longest suffix that ch extends
                node = fail[node]
            node = goto[node].get(ch, 0)
            self.pos += 1
            m = match[node]
            if m >= 0:
                s = a.stops[m]
                found = s if found is None else found
                start = self.pos - len(s)
                self.first = start if self.first is None else min(self.first, start)
        self.node = node
        return found

    @property
    def held(self) -> int:
        """Characters at the end of the text so far that could still grow into a stop string."""
        return self.stops._held[self.node]


class StopStringsCache:
    """The automata of the last `size` stop lists built: the n samples of a prompt, and clients
    that send the same list each time, build theirs once. Safe to share between threads."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._built: OrderedDict[tuple[str, ...], StopStrings] = OrderedDict()

    def get(self, stops: Sequence[str]) -> StopStrings:
        key = tuple(stops)
        built = self._built.get(key)
        if built is None:
            built = self._built[key] = StopStrings(key)
            while len(self._built) > self.size:
                self._built.popitem(last=False)
        return built
