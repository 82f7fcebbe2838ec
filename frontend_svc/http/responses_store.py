"""The responses a front-end keeps for `previous_response_id` and GET /v1/responses/{id}.

In memory, per front-end process: a response created on one front-end is unknown to another
(`splitserve up --frontends N`) and to the same one after a restart. Bounded three ways: at most
MAX_ENTRIES responses, MAX_BYTES of their JSON together, each kept TTL_S seconds after it was
made. The oldest go first when a bound is passed; a response over MAX_BYTES alone is not kept.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_ENTRIES = 1024
MAX_BYTES = 64 * 1024 * 1024
TTL_S = 3600.0


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict  # the response object as the client got it
    conversation: list[dict]  # input items so far and this response's output items, in order
    expires_at: float
    size: int  # bytes of JSON, what MAX_BYTES counts


class ResponseStore:
    """Insertion order is age order (one TTL for all), so expired and evicted entries are
    always at the front."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep `response` under its id; False when it is too big to keep at all."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes or self.max_entries <= 0:
            return False
        self.delete(response["id"])
        self._expire()
        while self._entries and (
            len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes
        ):
            self._pop_oldest()
        stored = StoredResponse(response, conversation, self.clock() + self.ttl_s, size)
        self._entries[response["id"]] = stored
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._bytes -= stored.size
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, stored = self._entries.popitem(last=False)
        self._bytes -= stored.size
