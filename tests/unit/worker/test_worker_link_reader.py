"""The worker link's reader thread: every message in order, then the stream's end or error."""

from __future__ import annotations

import queue

import grpc

from worker_svc.link import _read_stream


class FakeError(grpc.RpcError):
    pass


def drain_inbox(inbox: queue.SimpleQueue) -> list:
    items = []
    while True:
        item = inbox.get(timeout=5)
        items.append(item)
        if item is None:
            return items


def test_messages_then_end():
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read_stream(iter(["a", "b", "c"]), inbox)
    assert drain_inbox(inbox) == ["a", "b", "c", None]


def test_rpc_error_is_handed_over_before_the_end():
    def broken():
        yield "a"
        raise FakeError("gone")

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read_stream(broken(), inbox)
    items = drain_inbox(inbox)
    assert items[0] == "a" and isinstance(items[1], FakeError) and items[2] is None


def test_any_other_failure_still_ends_the_inbox():
    def broken():
        yield "a"
        raise ValueError("bad")

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    _read_stream(broken(), inbox)
    assert drain_inbox(inbox) == ["a", None]
