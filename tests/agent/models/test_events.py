"""The router's model events (:mod:`agent.models.events`), on a real model registry and the
queues `GET /models/sse` reads:

- a subscriber first gets the view of every model, then every change of state in order, with
  the reason as ``detail``; a model the registry does not know sends nothing, and while nobody
  listens no view is even built;
- a load refused for lack of room is an event of its own (``load_refused``): the model's state
  as it is, the message the waiting requests got and when to retry;
- a subscriber that stops reading is dropped and the others go on; one that left gets nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.errors import CapacityError
from agent.core.model_registry import ModelRegistry
from agent.models.events import SSE_QUEUE_LENGTH, ModelEventStream

MODELS = ("alpha", "beta", "gamma")


class Views:
    """The router's side: each model's view, read from the registry, and how often one was built."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.built = 0

    def model_info(self, name: str) -> dict[str, Any]:
        self.built += 1
        entry = self.registry.entries[name]
        return {"id": name, "object": "model", "state": str(entry.state), "active_requests": entry.active_requests}

    def models(self) -> list[dict[str, Any]]:
        return [self.model_info(name) for name in sorted(self.registry.entries)]


def stream_of(names: tuple[str, ...] = MODELS) -> tuple[ModelRegistry, Views, ModelEventStream]:
    registry = ModelRegistry()
    registry.set_models(names)
    views = Views(registry)
    return registry, views, ModelEventStream(registry, views.model_info, views.models)


def drain(queue: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_subscriber_gets_every_models_view_first_then_each_change_in_order():
    registry, _, stream = stream_of()
    with stream.subscribe() as queue:
        backlog = drain(queue)
        assert [(e["event"], e["model"], e["id"], e["state"]) for e in backlog] == [
            ("status_change", name, name, "unloaded") for name in sorted(MODELS)]

        registry.join("beta")
        registry.next_action()  # beta's load is claimed: it is measured first
        stream.status_changed("beta")
        stream.status_changed("alpha", reason="evicted for beta")
        events = drain(queue)
    assert [(e["event"], e["model"], e["state"]) for e in events] == [
        ("status_change", "beta", "measuring"), ("status_change", "alpha", "unloaded")]
    assert "detail" not in events[0] and events[1]["detail"] == "evicted for beta"
    assert events[0]["object"] == "model"  # the model's whole view travels with the event


def test_a_model_the_registry_does_not_know_sends_nothing():
    _, _, stream = stream_of()
    with stream.subscribe() as queue:
        drain(queue)
        stream.status_changed("ghost")
        stream.load_refused("ghost", CapacityError("no room", 10.0))
        assert queue.empty()


def test_without_subscribers_no_view_is_built_and_nothing_is_kept_for_later():
    _, views, stream = stream_of()
    stream.status_changed("alpha", reason="loaded")
    stream.load_refused("alpha", CapacityError("no room", 10.0))
    assert views.built == 0
    with stream.subscribe() as queue:
        assert [e["event"] for e in drain(queue)] == ["status_change"] * len(MODELS)  # the backlog only


def test_a_refused_load_is_its_own_event_with_the_state_as_it_is_and_when_to_retry():
    registry, _, stream = stream_of()
    with stream.subscribe() as queue:
        drain(queue)
        message = "cannot load model 'gamma' now: it needs 900 MiB on node n1; retry later"
        stream.load_refused("gamma", CapacityError(message, 10.0))
        stream.load_refused("alpha", CapacityError("model 'alpha' needs more than node n1 has", None))
        events = drain(queue)
    assert events == [
        {"event": "load_refused", "model": "gamma", "state": "unloaded", "detail": message, "retry_after_s": 10.0},
        {"event": "load_refused", "model": "alpha", "state": "unloaded",
         "detail": "model 'alpha' needs more than node n1 has", "retry_after_s": None},
    ]
    assert registry.entries["gamma"].state == "unloaded"  # telling of it changes nothing


def test_a_subscriber_that_stops_reading_is_dropped_and_the_others_go_on():
    _, _, stream = stream_of()
    with stream.subscribe() as stalled, stream.subscribe() as reading:
        drain(reading)
        for index in range(SSE_QUEUE_LENGTH + len(MODELS) + 5):
            stream.status_changed(MODELS[index % len(MODELS)], reason=f"change {index}")
            assert len(drain(reading)) == 1  # this one reads as they come
        assert stalled.qsize() == SSE_QUEUE_LENGTH + len(MODELS)  # full: it was dropped, not grown
        drain(stalled)
        stream.status_changed("alpha", reason="after the drop")
        assert stalled.empty()  # dropped for good, even once it reads again
        assert [e["detail"] for e in drain(reading)] == ["after the drop"]


def test_a_subscriber_that_left_gets_nothing_more():
    _, _, stream = stream_of()
    with stream.subscribe() as queue:
        drain(queue)
    stream.status_changed("alpha", reason="gone")
    assert queue.empty()
    with stream.subscribe() as again:  # a new subscriber starts from the views as they are now
        assert [e["model"] for e in drain(again)] == sorted(MODELS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*MODELS, "ghost", "other"]), st.none() | st.text(max_size=8)),
                max_size=30))
def test_every_change_of_a_known_model_reaches_a_subscriber_once_in_the_order_sent(changes):
    _, _, stream = stream_of()
    with stream.subscribe() as queue:
        drain(queue)
        for name, reason in changes:
            stream.status_changed(name, reason=reason)
        events = drain(queue)
    expected = [(name, reason) for name, reason in changes if name in MODELS]
    assert [(e["model"], e.get("detail")) for e in events] == expected
    assert all(e["event"] == "status_change" and e["state"] == "unloaded" for e in events)
