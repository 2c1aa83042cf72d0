"""A rate limit per key (a client address): a token bucket each, refilled at ``rate_per_s`` up
to ``burst``. Pure: time is a parameter; at most ``max_keys`` buckets are kept (the least
recently used go first), so a flood of addresses cannot grow it without bound."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class RateLimiter:
    rate_per_s: float
    burst: int
    max_keys: int = 4096
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)  # key -> (tokens, at)

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or self.burst < 1 or self.max_keys < 1:
            raise ValueError("a rate limit needs rate_per_s > 0, burst >= 1 and max_keys >= 1")

    def allow(self, key: str, *, now: float) -> float | None:
        """Take one token of ``key``'s bucket: None when allowed, else the whole seconds until
        the next token (a Retry-After)."""
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        allowed = tokens >= 1.0 - 1e-9  # a request made exactly when Retry-After said (float rounding)
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return None if allowed else float(max(1, math.ceil((1.0 - tokens) / self.rate_per_s)))
