"""The paths agents call on each other: every internal endpoint, in one place.

Internal endpoints answer only over mutual TLS on the peer port, to requests signed with the
cluster key (`agent/core/auth.py`); their answers are signed too. What they carry is
validated by the wire schemas of :mod:`agent.core.wire` and :mod:`agent.core.orders`.
"""

from __future__ import annotations

INTERNAL_PREFIX = "/internal/"
DESCRIBE_PATH = "/internal/describe"  # membership: a node's advert, extras and the peers it knows
STATE_PATH = "/internal/state"  # a node's worker and fault state
ROUTING_PATH = "/internal/routing"  # stage a routing order (build its fragments)
COMMIT_PATH = "/internal/routing/commit"  # serve the staged order
ABORT_PATH = "/internal/routing/abort"  # drop the staged order
UNLOAD_PATH = "/internal/unload"  # drop a model's orders and fragments
COPY_PATH = "/internal/copy"  # keep a whole copy of a model (the fallback)
REKEY_PATH = "/internal/rekey"  # the new cluster key after a node is removed
STREAM_PATH = "/internal/stream"  # the data plane: a WebSocket of step, result, busy and close frames
MODEL_LISTING_PATH = "/internal/models/{name}"  # a stored model's files, sizes and sha256
MODEL_FILE_PATH = "/internal/models/{name}/files/{path}"  # one file (Range requests resume)
PAIR_PATH = "/cluster/pair"  # public: a new device redeems an invite (it holds no key yet)


def model_listing_path(name: str) -> str:
    return MODEL_LISTING_PATH.format(name=name)


def model_file_path(name: str, relative: str) -> str:
    return MODEL_FILE_PATH.format(name=name, path=relative)
