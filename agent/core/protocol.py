"""What agents say to each other: every internal endpoint, and the frames of the data plane.

Internal endpoints answer only over mutual TLS on the peer port, to requests signed with the
cluster key (`agent/core/auth.py`); their answers are signed too. What they carry is
validated by the wire schemas of :mod:`agent.core.wire` and :mod:`agent.core.orders`.

The data plane (:data:`STREAM_PATH`, a WebSocket per pair of nodes) carries frames: a
:class:`StepFrame` (with its tensor: token ids at the head, hidden states after) goes from the
orchestrator to the head and from each stage to the next. A step names its ``reply`` node,
the orchestrator: the tail sends its :class:`ResultFrame` (the sampled token) straight there,
and a stage that fails, or whose next stage does not take the step, sends its
:class:`ErrorFrame` there too; nothing goes back along the chain,
so a token crosses each link once. The orchestrator finds frozen and vanished stages itself:
:class:`PingFrame` s, which a live node answers with a :class:`PongFrame` at once. A :class:`CloseFrame`
frees a session on a stage, or keeps its cache for a later request that begins the same
way (a step's ``reuse`` takes it over).
Each frame is a header validated by :data:`agent.core.wire.SCHEMAS` on decode; the link adds
``cid``, which pairs a pong with its ping on that link.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from agent.core.errors import WireError
from agent.core.wire import MAX_DRAFT_TOKENS

INTERNAL_PREFIX = "/internal/"
DESCRIBE_PATH = "/internal/describe"  # membership: a node's advert, extras and the peers it knows
STATE_PATH = "/internal/state"  # a node's worker and fault state
ROUTING_PATH = "/internal/routing"  # stage a routing order (build its fragments)
COMMIT_PATH = "/internal/routing/commit"  # serve the staged order
ABORT_PATH = "/internal/routing/abort"  # drop the staged order
UNLOAD_PATH = "/internal/unload"  # drop a model's orders and fragments
COPY_PATH = "/internal/copy"  # keep a whole copy of a model (the fallback)
REKEY_PATH = "/internal/rekey"  # the new cluster key after a node is removed
EMBED_PATH = "/internal/embed"  # embed texts with an embedding model the router placed on this node
STREAM_PATH = "/internal/stream"  # the data plane: a WebSocket of step, result, error, close and ping frames
MODEL_LISTING_PATH = "/internal/models/{name}"  # a stored model's files, sizes and sha256
MODEL_FILE_PATH = "/internal/models/{name}/files/{path}"  # one file (Range requests resume)
PAIR_PATH = "/cluster/pair"  # public: a new device redeems an invite (it holds no key yet)


def model_listing_path(name: str) -> str:
    return MODEL_LISTING_PATH.format(name=name)


def model_file_path(name: str, relative: str) -> str:
    return MODEL_FILE_PATH.format(name=name, path=relative)


@dataclass(frozen=True)
class StepFrame:
    """Run the layers from ``layer`` on, for session ``sid`` at positions ``start``...; the
    tail samples the next token when ``sample`` (with ``params``, sent on a session's first
    step), or returns the final hidden state of the last position when ``embed`` (a
    prompt's embedding). Its result, or the failure of any stage, goes straight to ``reply`` (a node id,
    reached at ``reply_url``): the orchestrator, which names itself there before it sends
    the step (:meth:`replying_to`)."""

    sid: str
    seq: int
    layer: int
    start: int
    epoch: int
    plan: int
    sample: bool
    params: Mapping[str, Any] | None = None
    reply: str | None = None
    reply_url: str | None = None
    reuse: str | None = None  # a kept session whose cache, cut to ``start`` positions, this one takes over
    embed: bool = False
    draft: tuple[int, ...] = ()  # tokens drafted after the step's last input one: the tail verifies them

    def __post_init__(self) -> None:
        if len(self.draft) > MAX_DRAFT_TOKENS:
            raise WireError(f"step frame: at most {MAX_DRAFT_TOKENS} drafted tokens, got {len(self.draft)}")

    def header(self) -> dict[str, Any]:
        header = {"kind": "step", "sid": self.sid, "seq": self.seq, "layer": self.layer, "start": self.start,
                  "epoch": self.epoch, "plan": self.plan, "sample": self.sample}
        if self.embed:
            header["embed"] = True
        if self.params is not None:
            header["params"] = dict(self.params)
        if self.reuse is not None:
            header["reuse"] = self.reuse
        if self.draft:
            header["draft"] = list(self.draft)
        if self.reply is not None and self.reply_url is not None:
            header["reply"], header["reply_url"] = self.reply, self.reply_url
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> StepFrame:
        """The step of a decoded (so validated) header."""
        return cls(header["sid"], header["seq"], header["layer"], header["start"], header["epoch"], header["plan"],
                   header["sample"], header.get("params"), header.get("reply"), header.get("reply_url"),
                   header.get("reuse"), header.get("embed", False), tuple(header.get("draft", ())))

    def replying_to(self, node_id: str, url: str) -> StepFrame:
        """The same step, its outcome sent straight to ``node_id`` (at ``url``)."""
        return replace(self, reply=node_id, reply_url=url)

    def at_layer(self, layer: int) -> StepFrame:
        """The same step, for the stage whose layers start at ``layer``."""
        return replace(self, layer=layer)


@dataclass(frozen=True)
class ResultFrame:
    """The tail's answer to a step: the sampled token (None when the step did not sample) and,
    when the request asks, its log-probability and the likeliest alternatives
    (``logprobs``: ``(logprob, ((id, logprob), ...))``); for an ``embed`` step, the final
    hidden state of its last position (``embedding``, float32)."""

    sid: str
    seq: int
    token: int | None
    logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None
    embedding: np.ndarray | None = None
    more: tuple[int, ...] = ()  # a speculative step's: the tokens accepted after ``token``, in order

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token the step chose, in order."""
        return () if self.token is None else (self.token, *self.more)

    def header(self) -> dict[str, Any]:
        header = {"kind": "result", "sid": self.sid, "seq": self.seq, "token": self.token}
        if self.more:
            header["more"] = list(self.more)
        if self.logprobs is not None:
            header["logprobs"] = {"logprob": self.logprobs[0], "top": [list(pair) for pair in self.logprobs[1]]}
        if self.embedding is not None:
            header["embedding"] = np.ascontiguousarray(self.embedding, "<f4").tobytes()
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> ResultFrame:
        logprobs = header.get("logprobs")
        if logprobs is not None:
            try:
                logprobs = (float(logprobs["logprob"]), tuple((int(i), float(lp)) for i, lp in logprobs["top"]))
            except (KeyError, TypeError, ValueError):
                raise WireError("result frame: 'logprobs' must be {\"logprob\", \"top\": [[id, logprob], ...]}") from None
        embedding = header.get("embedding")
        return cls(header["sid"], header["seq"], header["token"], logprobs,
                   None if embedding is None else np.frombuffer(embedding, "<f4"), tuple(header.get("more", ())))


@dataclass(frozen=True)
class ErrorFrame:
    """Step (``sid``, ``seq``) failed: ``code`` and ``message`` say why, ``node`` is the node
    that failed (None: the step's own fault, which never triggers a failover)."""

    sid: str
    seq: int
    code: str
    message: str
    node: str | None = None

    def header(self) -> dict[str, Any]:
        return {"kind": "error", "sid": self.sid, "seq": self.seq, "code": self.code, "message": self.message,
                "node": self.node}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> ErrorFrame:
        return cls(header["sid"], header["seq"], header["code"], header["message"], header.get("node"))


@dataclass(frozen=True)
class _LivenessFrame:
    """A ping or a pong: ``cid`` pairs the two on a link."""

    cid: int
    kind: ClassVar[str]

    def header(self) -> dict[str, Any]:
        return {"kind": self.kind, "cid": self.cid}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> _LivenessFrame:
        return cls(header.get("cid", 0))


@dataclass(frozen=True)
class PingFrame(_LivenessFrame):
    """Is the peer alive? A live one answers at once with the :class:`PongFrame` of ``cid``."""

    kind: ClassVar[str] = "ping"

    def pong(self) -> PongFrame:
        return PongFrame(self.cid)


@dataclass(frozen=True)
class PongFrame(_LivenessFrame):
    """The answer to the :class:`PingFrame` of ``cid``."""

    kind: ClassVar[str] = "pong"


@dataclass(frozen=True)
class CloseFrame:
    """Free session ``sid`` on the stage whose layers start at ``layer`` (of plan ``plan``),
    or, with ``keep``, keep its cache for a later request (the orchestrator's prompt cache)."""

    sid: str
    layer: int
    plan: int
    keep: bool = False

    def header(self) -> dict[str, Any]:
        header = {"kind": "close", "sid": self.sid, "layer": self.layer, "plan": self.plan}
        if self.keep:
            header["keep"] = True
        return header

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> CloseFrame:
        return cls(header["sid"], header["layer"], header.get("plan", 0), header.get("keep", False))




# --- the control plane: bodies of the internal POSTs ------------------------------------------
# Each is built by its sender with the class and read by its handler with ``from_json``, which
# raises WireError (answered 400) for a body that is not one.
def _fields(body: Any, what: str, spec: Mapping[str, type | tuple[type, ...]]) -> list[Any]:
    """The fields ``spec`` names, each of its type (no bool for an int), or WireError naming ``what``."""
    wanted = ", ".join(f"{name!r}: {getattr(kind, '__name__', 'value')}" for name, kind in spec.items())
    if not isinstance(body, Mapping):
        raise WireError(f"{what} is a JSON object {{{wanted}}}")
    values = []
    for name, kind in spec.items():
        value = body.get(name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise WireError(f"{what} needs {wanted}; {name!r} is missing or of another type")
        values.append(value)
    return values


@dataclass(frozen=True)
class OrderStep:
    """Commit or abort (by the path it is sent to) the staged order of ``name``."""

    name: str
    plan_version: int
    epoch: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "plan_version": self.plan_version, "epoch": self.epoch}

    @classmethod
    def from_json(cls, body: Any) -> OrderStep:
        return cls(*_fields(body, "an order step", {"name": str, "plan_version": int, "epoch": int}))


@dataclass(frozen=True)
class UnloadOrder:
    """Drop model ``name``'s orders and fragments (unloaded, evicted or asleep)."""

    name: str
    epoch: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "epoch": self.epoch}

    @classmethod
    def from_json(cls, body: Any) -> UnloadOrder:
        return cls(*_fields(body, "an unload order", {"name": str, "epoch": int}))


@dataclass(frozen=True)
class CopyOrder:
    """Hold a whole copy of ``model`` (the fallback), fetched from ``sources``: (node, URL) pairs."""

    model: str
    sources: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "sources": [list(source) for source in self.sources]}

    @classmethod
    def from_json(cls, body: Any) -> CopyOrder:
        model, sources = _fields(body, "a copy order", {"model": str, "sources": list})
        if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in sources):
            raise WireError("a copy order's 'sources' are [node, url] pairs")
        return cls(model, tuple((node, url) for node, url in sources))


MAX_EMBED_TEXTS = 2048


@dataclass(frozen=True)
class EmbedOrder:
    """Embed ``texts`` with embedding model ``model`` on this node, where the router placed it
    (its files fetched from ``sources`` first when this node does not store it); ``truncate``
    cuts a text longer than the model reads; ``keep_alive_s`` (None: the idle rule) is the
    request's Ollama keep_alive, which may ``close`` the model now when it is 0."""

    model: str
    texts: tuple[str, ...]
    truncate: bool
    sources: tuple[tuple[str, str], ...]
    keep_alive_s: float | None = None
    close: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "texts": list(self.texts), "truncate": self.truncate,
                "sources": [list(source) for source in self.sources], "keep_alive_s": self.keep_alive_s,
                "close": self.close}

    @classmethod
    def from_json(cls, body: Any) -> EmbedOrder:
        model, texts, truncate, sources, close = _fields(
            body, "an embed order", {"model": str, "texts": list, "truncate": bool, "sources": list, "close": bool})
        if not 1 <= len(texts) <= MAX_EMBED_TEXTS or not all(isinstance(text, str) for text in texts):
            raise WireError(f"an embed order's 'texts' are 1 to {MAX_EMBED_TEXTS} strings")
        if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in sources):
            raise WireError("an embed order's 'sources' are [node, url] pairs")
        keep_alive_s = body.get("keep_alive_s")
        if keep_alive_s is not None and (isinstance(keep_alive_s, bool) or not isinstance(keep_alive_s, (int, float))):
            raise WireError("an embed order's 'keep_alive_s' is a number or null")
        return cls(model, tuple(texts), truncate, tuple((node, url) for node, url in sources),
                   None if keep_alive_s is None else float(keep_alive_s), close)


@dataclass(frozen=True)
class Embeddings:
    """What an embedding request got (and a node answers an :class:`EmbedOrder`): a vector
    per text (float32), the tokens read, the seconds spent opening the model (0 when it was
    open) and embedding."""

    vectors: np.ndarray
    prompt_tokens: int
    load_s: float
    embed_s: float

    def to_json(self) -> dict[str, Any]:
        vectors = np.ascontiguousarray(self.vectors, "<f4")
        return {"vectors": base64.b64encode(vectors.tobytes()).decode(), "shape": list(vectors.shape),
                "prompt_tokens": self.prompt_tokens, "load_s": self.load_s, "embed_s": self.embed_s}

    @classmethod
    def from_json(cls, body: Any) -> Embeddings:
        packed, shape, prompt_tokens = _fields(body, "an embed answer", {"vectors": str, "shape": list,
                                                                         "prompt_tokens": int})
        load_s, embed_s = body.get("load_s"), body.get("embed_s")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in (load_s, embed_s)):
            raise WireError("an embed answer's 'load_s' and 'embed_s' are seconds")
        if len(shape) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise WireError("an embed answer's 'shape' is [texts, dimensions]")
        try:
            vectors = np.frombuffer(base64.b64decode(packed, validate=True), "<f4").reshape(shape)
        except ValueError as error:
            raise WireError(f"an embed answer's 'vectors' are not its shape {shape}: {error}") from None
        return cls(vectors, prompt_tokens, float(load_s), float(embed_s))


MAX_REKEY_PEERS = 16


@dataclass(frozen=True)
class RekeyOrder:
    """The new cluster key after a node was removed, and the members' URLs."""

    cluster: str
    key: str
    peers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "key": self.key, "peers": list(self.peers)}

    @classmethod
    def from_json(cls, body: Any) -> RekeyOrder:
        cluster, key, peers = _fields(body, "a rekey order", {"cluster": str, "key": str, "peers": list})
        if not 16 <= len(key) <= 256:
            raise WireError("a rekey order's key has 16-256 characters")
        if not all(isinstance(p, str) and p.startswith(("http://", "https://")) for p in peers):
            raise WireError("a rekey order's 'peers' are http(s) URLs")
        return cls(cluster, key, tuple(peers[:MAX_REKEY_PEERS]))


@dataclass(frozen=True)
class PairRequest:
    """A new device redeems invite ``invite``: ``proof`` (the HMAC of its secret over the invite
    and ``nonce``) shows it holds the secret; ``cluster`` and ``fingerprint`` are what its join
    string says (absent from devices of older versions), checked before the invite is used."""

    invite: str
    nonce: str
    proof: str
    cluster: str | None = None
    fingerprint: str | None = None

    def to_json(self) -> dict[str, Any]:
        body = {"invite": self.invite, "nonce": self.nonce, "proof": self.proof}
        if self.cluster is not None and self.fingerprint is not None:
            body.update(cluster=self.cluster, fingerprint=self.fingerprint)
        return body

    @classmethod
    def from_json(cls, body: Any) -> PairRequest:
        invite, nonce, proof = _fields(body, "a pairing request", {"invite": str, "nonce": str, "proof": str})
        cluster, fingerprint = body.get("cluster"), body.get("fingerprint")
        if any(len(value) > 128 for value in (invite, nonce, proof)):
            raise WireError("a pairing request's fields have at most 128 characters")
        if (cluster is None) != (fingerprint is None) or not all(
                value is None or (isinstance(value, str) and len(value) <= 128) for value in (cluster, fingerprint)):
            raise WireError("a pairing request names both 'cluster' and 'fingerprint' (strings), or neither")
        return cls(invite, nonce, proof, cluster, fingerprint)
