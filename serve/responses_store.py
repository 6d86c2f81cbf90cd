"""The Responses API's store: finished responses by id, in memory, the newest `capacity` kept (least recently
used dropped first), for GET /v1/responses/{id} and for `previous_response_id` (a response's conversation, its
input and its answer as chat messages, continues in the next request)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from serve.responses_protocol import Response


@dataclass(frozen=True)
class Stored:
    response: Response
    messages: list[dict]  # the conversation up to and with this response's answer (chat messages, no instructions)


class ResponseStore:
    """At most `capacity` responses (0: none kept); reading one (get) makes it the most recently used."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: Response, messages: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._items[response.id] = Stored(response, messages)
        self._items.move_to_end(response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        got = self._items.get(response_id)
        if got is not None:
            self._items.move_to_end(response_id)
        return got

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
