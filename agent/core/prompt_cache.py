"""The prompt cache of one model, as the orchestrator keeps its books (design: the
orchestrator decides, the stages obey).

When a request ends, every stage of its route keeps the request's KV cache instead of freeing
it (a ``close`` frame with ``keep``). The next request that begins with the same tokens (the
next turn of a chat; the same instructions and tools on every turn) takes the kept cache over
(its first step's ``reuse``), cut where the two token lists part, and reads only the rest.
This is llama.cpp's server's per-slot prompt cache (the longest common prefix with what a slot
holds) rather than vLLM's hashed blocks: a home's few conversations each resend one long
prefix, a kept session is one row of a stage's KV pool, and taking it over copies nothing.

Pure: no clock (``now_s`` is a parameter), no I/O. The token loop sends the frames; a stage
that no longer holds a kept session answers ``cache_miss`` and the request reads its whole
prompt, so these books may be wrong without harm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_REUSED_TOKENS = 32  # a shorter common prefix is not worth taking a kept cache away from its conversation


@dataclass(frozen=True)
class KeptPrompt:
    """A finished request's KV cache that the stages of plan ``plan`` keep under ``sid``:
    the positions of ``tokens``; ``node``: the head of the route it ran on (a model placed as
    whole copies keeps it on that copy alone)."""

    sid: str
    tokens: tuple[int, ...]
    plan: int
    kept_s: float
    node: str = ""


@dataclass
class PromptCache:
    """At most ``entries`` kept caches per route (per whole copy of a model placed as copies),
    the least recently kept freed first; one unused for ``idle_s`` is freed too."""

    entries: int
    idle_s: float
    min_reused_tokens: int = MIN_REUSED_TOKENS
    _kept: list[KeptPrompt] = field(default_factory=list)  # oldest first

    def __post_init__(self) -> None:
        if self.entries < 0 or not self.idle_s > 0 or self.min_reused_tokens < 1:
            raise ValueError("a prompt cache needs entries >= 0, idle_s > 0 and min_reused_tokens >= 1")

    @property
    def kept(self) -> tuple[KeptPrompt, ...]:
        return tuple(self._kept)

    def take(self, prompt: Sequence[int], plan: int, now_s: float,
             node: str = "") -> tuple[KeptPrompt | None, int, list[KeptPrompt]]:
        """The kept cache on plan ``plan`` (and on ``node``'s route, when given) whose tokens
        share the longest beginning with ``prompt`` (no longer kept: the request's session
        takes it over) and how many positions of it the request reuses (never its last token:
        that one is computed for its logits); and the caches to free now: idle too long.
        Caches of another plan are forgotten (their stages free them with the plan)."""
        expired = [k for k in self._kept if k.plan == plan and now_s - k.kept_s >= self.idle_s]
        self._kept = [k for k in self._kept if k.plan == plan and k not in expired]
        best, best_length = None, 0
        for kept in self._kept:
            if node and kept.node != node:
                continue
            length = _common_length(kept.tokens, prompt, len(prompt) - 1)
            if length > best_length:
                best, best_length = kept, length
        if best is None or best_length < self.min_reused_tokens:
            return None, 0, expired
        self._kept.remove(best)
        return best, best_length, expired

    def reuse_by_node(self, prompt: Sequence[int], plan: int) -> dict[str, int]:
        """Per node, the most positions a request with ``prompt`` on plan ``plan`` would
        reuse from what that node's route keeps (at least :attr:`min_reused_tokens`)."""
        reuse: dict[str, int] = {}
        for kept in self._kept:
            if kept.plan == plan:
                length = _common_length(kept.tokens, prompt, len(prompt) - 1)
                if length >= self.min_reused_tokens:
                    reuse[kept.node] = max(reuse.get(kept.node, 0), length)
        return reuse

    def keep(self, kept: KeptPrompt) -> list[KeptPrompt]:
        """Remember ``kept``; the caches beyond ``entries`` on its node's route (each whole
        copy keeps its own), the least recently kept, come back, to free."""
        self._kept.append(kept)
        there = [k for k in self._kept if k.node == kept.node]
        evicted = there[:max(len(there) - self.entries, 0)]
        self._kept = [k for k in self._kept if k not in evicted]
        return evicted


def _common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many first tokens ``a`` and ``b`` share, at most ``limit``."""
    length = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        length += 1
    return length


__all__ = ["MIN_REUSED_TOKENS", "KeptPrompt", "PromptCache"]
