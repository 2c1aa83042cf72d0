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
from dataclasses import dataclass, field, replace
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


@dataclass(frozen=True)
class PairAnswer:
    """A member's answer to a redeemed invite: its cluster's name, its live peers, and the
    cluster key sealed with the invite's secret (``iv``, ``sealed_key``: hex)."""

    cluster: str
    peers: tuple[str, ...]
    iv: str
    sealed_key: str

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "peers": list(self.peers), "iv": self.iv, "sealed_key": self.sealed_key}

    @classmethod
    def from_json(cls, body: Any) -> PairAnswer:
        cluster, iv, sealed_key = _fields(body, "a pairing answer", {"cluster": str, "iv": str, "sealed_key": str})
        peers = body.get("peers")
        return cls(cluster, tuple(_urls(peers if isinstance(peers, list) else [])), iv, sealed_key)


def _urls(values: list[Any]) -> list[str]:
    """The http(s) URLs among ``values`` (a peer's list: anything else is left out)."""
    return [u for u in values if isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) < 256]


@dataclass(frozen=True)
class Introduction:
    """What a describe request says of its caller: its API port, and its URL when it knows it."""

    api_port: int | None = None
    url: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"api_port": self.api_port, "url": self.url}

    @classmethod
    def from_json(cls, body: Any) -> Introduction:
        """The introduction in ``body``; a field that is no port or URL reads as absent."""
        if not isinstance(body, Mapping):
            return cls()
        port, url = body.get("api_port"), body.get("url")
        return cls(port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None,
                   url if _urls([url]) else None)

    def address(self, remote: str | None) -> str | None:
        """Where the caller is reached: its URL, else its address (``remote``) and API port."""
        if self.url is not None:
            return self.url
        if self.api_port is None or not remote:
            return None
        return f"http://[{remote}]:{self.api_port}" if ":" in remote else f"http://{remote}:{self.api_port}"


@dataclass(frozen=True)
class Description:
    """A node's answer to a describe: its advert (JSON: :class:`agent.core.advert.NodeAdvert`
    reads it), the live peers it knows, the address it sees the caller at (``you``) and what
    it reports of itself beyond the advert (``report``: its models, worker, device memory,
    open embedding models, detected devices)."""

    advert: Mapping[str, Any]
    peers: tuple[str, ...] = ()
    you: str | None = None
    report: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.report, "advert": dict(self.advert), "peers": list(self.peers), "you": self.you}

    @classmethod
    def from_json(cls, body: Any) -> Description:
        if not isinstance(body, Mapping) or not isinstance(body.get("advert"), Mapping):
            raise WireError("a description is a JSON object with an 'advert'")
        peers, you = body.get("peers"), body.get("you")
        return cls(body["advert"], tuple(_urls(peers if isinstance(peers, list) else [])),
                   you if isinstance(you, str) and len(you) < 64 else None,
                   {k: v for k, v in body.items() if k not in ("advert", "peers", "you")})


@dataclass(frozen=True)
class ModelListing:
    """What a node serves of a stored model (`GET /internal/models/{name}`): its manifest (a
    chat model's) or ``encoder`` manifest (an embedding model's), as JSON, and the size and
    sha256 of its tokenizer files (``meta_files``)."""

    kind: str  # "manifest" or "encoder"
    document: Mapping[str, Any]
    meta_files: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {self.kind: dict(self.document),
                "meta_files": {name: {"bytes": size, "sha256": digest} for name, (size, digest) in self.meta_files.items()}}

    @classmethod
    def from_json(cls, body: Any, kind: str) -> ModelListing:
        """The listing of a model of ``kind``; WireError when ``body`` is none."""
        if not isinstance(body, Mapping) or not isinstance(body.get(kind), Mapping):
            raise WireError(f"a model listing holds its {kind} as a JSON object")
        meta, files = body.get("meta_files", {}), {}
        for name, entry in meta.items() if isinstance(meta, Mapping) else ():
            size, digest = _fields(entry, f"a listing's file {str(name)[:40]!r}", {"bytes": int, "sha256": str})
            files[str(name)] = (size, digest)
        return cls(kind, body[kind], files)


@dataclass(frozen=True)
class CopyQueued:
    """A node's answer to a :class:`CopyOrder`: whether it queued the fetch (False: it holds
    the model already, or is fetching it)."""

    queued: bool

    def to_json(self) -> dict[str, Any]:
        return {"queued": self.queued}


@dataclass(frozen=True)
class Rekeyed:
    """A node's answer to a :class:`RekeyOrder`: it took the new key and restarts (``node``)."""

    node: str

    def to_json(self) -> dict[str, Any]:
        return {"rekeyed": self.node}
