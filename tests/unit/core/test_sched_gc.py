"""The opt-in GC settings helper restores what it changed."""

from __future__ import annotations

import gc

from scheduler_svc.core import restore_gc, tune_gc_for_serving


def test_tune_and_restore_gc():
    before = gc.get_threshold()
    old = tune_gc_for_serving(gen0_threshold=12_345)
    try:
        assert old == before
        assert gc.get_threshold()[0] == 12_345
        assert gc.get_freeze_count() > 0
    finally:
        restore_gc(old)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
