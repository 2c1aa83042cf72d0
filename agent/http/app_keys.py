"""Typed keys of the objects the aiohttp application holds."""

from __future__ import annotations

from aiohttp import web

from agent.local.config import AgentConfig
from agent.local.lifecycle import Lifecycle
from agent.local.log_throttle import ThrottledWarning

CONFIG = web.AppKey("config", AgentConfig)
NODE_ID = web.AppKey("node_id", str)
STORE = web.AppKey("store", "ModelStore")
CLIENT = web.AppKey("client", "PeerClient")
LINKS = web.AppKey("links", "Links")  # the worker's, to the next stages
RESULTS = web.AppKey("results", "Replies")  # the results tails send here, for the requests this node runs
MEMBERSHIP = web.AppKey("membership", "Membership")
WORKER = web.AppKey("worker", "Worker")
ORCHESTRATOR = web.AppKey("orchestrator", "Orchestrator")
ROUTER = web.AppKey("router", "ModelRouter")
EMBEDDINGS = web.AppKey("embeddings", "EmbeddingModels")
REPLAY_GUARD = web.AppKey("replay_guard", "ReplayGuard")
ADMIN_TOKEN = web.AppKey("admin_token", str)
DATA_PLANE_SOCKETS = web.AppKey("data_plane_sockets", set)
INVITES = web.AppKey("invites", "InviteStore")
EVENTS = web.AppKey("events", "EventLog")
METRICS = web.AppKey("metrics", "Metrics")
SCRUBBER = web.AppKey("scrubber", "Scrubber")
PAIR_LIMIT = web.AppKey("pair_limit", "RateLimiter")  # attempts at /cluster/pair per address
DRAIN_TIMEOUT_S = web.AppKey("drain_timeout_s", float)  # a stopping agent lets its requests finish this long
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
# this agent's own counts of what strangers cause (agents in one process count apart)
REFUSED_INVITES = web.AppKey("refused_invites", ThrottledWarning)
REFUSED_INTERNAL = web.AppKey("refused_internal", ThrottledWarning)
