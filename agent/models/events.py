"""The router's model events, fanned out to the `GET /models/sse` subscribers: every change of a
model's state (``status_change``, with the model's view) and every load refused for lack of room
(``load_refused``). A subscriber that stops reading is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from agent.core.errors import RouterError
from agent.core.model_registry import ModelRegistry
from agent.local.events import Fanout

SSE_QUEUE_LENGTH = 256


class ModelEventStream:
    def __init__(self, registry: ModelRegistry, model_info: Callable[[str], dict[str, Any]],
                 models: Callable[[], list[dict[str, Any]]]) -> None:
        """``model_info``: the view of one model; ``models``: the views of every model."""
        self._registry = registry
        self._model_info = model_info
        self._models = models
        self._subscribers: Fanout[dict[str, Any]] = Fanout(SSE_QUEUE_LENGTH)

    def status_changed(self, name: str, *, reason: str | None = None) -> None:
        """``name`` changed state (or its view did): send its view."""
        if not self._subscribers or name not in self._registry.entries:
            return
        event = {"event": "status_change", "model": name, **self._model_info(name)}
        if reason is not None:
            event["detail"] = reason
        self._subscribers.send(event)

    def load_refused(self, name: str, error: RouterError) -> None:
        """A load refused for lack of room is not a change of state: its own event, with the
        model's state as it is and the message the waiting requests got."""
        if not self._subscribers or name not in self._registry.entries:
            return
        retry_after_s = getattr(error, "retry_after_s", None)
        event = {"event": "load_refused", "model": name, "state": self._registry.entries[name].state,
                 "detail": str(error), "retry_after_s": retry_after_s}
        self._subscribers.send(event)

    def subscribe(self) -> contextlib.AbstractContextManager[asyncio.Queue[dict[str, Any]]]:
        """Events of every state change, starting with the state of every model."""
        return self._subscribers.subscribe({"event": "status_change", "model": info["id"], **info}
                                           for info in self._models())
