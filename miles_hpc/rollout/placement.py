"""Where the router sends a request: least-in-flight with prefix affinity (stage: rollout; no I/O, unit-testable).

Invariants:
- ``pick`` returns an engine that is not quarantined, or raises :class:`NoEngineAvailableError`.
- Without a key, the engine with the fewest requests in flight wins; ties go round-robin (so an idle fleet is filled
  evenly, not engine 0 first).
- With a key, the engine that served the key last wins unless its in-flight count exceeds the least-loaded engine's
  by more than ``margin`` (then the key moves to the least-loaded, where the next samples of the group will find the
  prefix the moved request leaves in the cache). A quarantined home engine always loses its keys.
- The key map keeps at most ``capacity`` keys (least recently used forgotten first): keys are per prompt group or
  session and a long run sees millions of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class NoEngineAvailableError(RuntimeError):
    """No engine can take the request: every engine is quarantined (the message names each with its last error),
    or a generation exhausted its resubmissions."""


class EngineSelector:
    def __init__(self, n: int, *, margin: int, capacity: int = 1 << 16) -> None:
        if n < 1 or margin < 0 or capacity < 1:
            raise ValueError(f"EngineSelector(n={n}, margin={margin}, capacity={capacity})")
        self.n = n
        self.margin = margin
        self.capacity = capacity
        self.in_flight = [0] * n
        self.quarantined: set[int] = set()
        self.affinity: OrderedDict[Hashable, int] = OrderedDict()
        self._next = 0  # where tie-breaking starts

    def available(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.quarantined]

    def pick(self, key: Hashable | None = None) -> int:
        candidates = self.available()
        if not candidates:
            raise NoEngineAvailableError("every engine is quarantined")
        least = min(candidates, key=lambda i: (self.in_flight[i], (i - self._next) % self.n))
        if key is not None:
            home = self.affinity.get(key)
            if (
                home is not None
                and home not in self.quarantined
                and self.in_flight[home] - self.in_flight[least] <= self.margin
            ):
                self.affinity.move_to_end(key)
                return home
            self.remember(key, least)
        self._next = (least + 1) % self.n
        return least

    def remember(self, key: Hashable, engine: int) -> None:
        """``key``'s prefix now lives on ``engine`` (placement, or a continuation that had to move)."""
        self.affinity[key] = engine
        self.affinity.move_to_end(key)
        while len(self.affinity) > self.capacity:
            self.affinity.popitem(last=False)
