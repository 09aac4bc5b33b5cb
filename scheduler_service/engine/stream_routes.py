"""The engine thread's routing of token updates to the streams (async_engine.py): the hub
(one per event loop, stream_hub.py) each request in the core streams to, and the loop turn's
updates and errors per hub, handed to each hub's loop in ONE `call_soon_threadsafe`, not one per
stream. Engine thread only.
"""
from __future__ import annotations

from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.stream_hub import StreamError, StreamHub


class StreamRoutes:
    """request id -> its hub, while the request is in the core, and the turn's outbox."""

    def __init__(self):
        self._hub_of: dict[str, StreamHub] = {}
        self._outbox: dict[StreamHub, list] = {}

    def __len__(self) -> int:
        return len(self._hub_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._hub_of

    def open(self, request_id: str, hub: StreamHub) -> None:
        """The request is in the core: its updates go to `hub` until its final one."""
        self._hub_of[request_id] = hub

    def close(self, request_id: str) -> bool:
        """Route nothing more to the request (the serving side ended it, or an abort did);
        False when it had no route."""
        return self._hub_of.pop(request_id, None) is not None

    def route(self, updates: list[TokenUpdate]) -> None:
        """File each update with its request's hub; a final update ends the route."""
        hub_of = self._hub_of
        for update in updates:
            hub = hub_of.get(update.request_id)
            if hub is None:
                continue
            self.post(hub, update)
            if update.finished:
                del hub_of[update.request_id]

    def post(self, hub: StreamHub, item: TokenUpdate | StreamError) -> None:
        """Queue `item` for `hub` until the next hand-off."""
        self._outbox.setdefault(hub, []).append(item)

    def fail_all(self, error: Exception) -> None:
        """End every routed stream with `error` (at the next hand-off)."""
        for rid, hub in self._hub_of.items():
            self.post(hub, StreamError(rid, error))
        self._hub_of.clear()

    def hand_off(self) -> None:
        """One call_soon_threadsafe per hub with anything to deliver."""
        outbox, self._outbox = self._outbox, {}
        for hub, items in outbox.items():
            try:
                hub.loop.call_soon_threadsafe(hub.deliver, items)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                pass
