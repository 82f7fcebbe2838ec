"""--stream-interval: fixed, or adaptive to how long workers wait on the scheduler."""

import pytest

from scheduler_svc.engine.stream_pacing import MAX_ADAPTIVE_INTERVAL, StreamPacer


def feed(pacer: StreamPacer, idle_s: float, seconds: float, start: float, dt: float = 0.05):
    """Steps every dt seconds with the same idle gap; the intervals it changed to."""
    changes, t = [], start
    while t < start + seconds:
        changed = pacer.on_step(idle_s, t)
        if changed is not None:
            changes.append(changed)
        t += dt
    return changes, t


def test_fixed_interval_never_changes():
    pacer = StreamPacer.from_setting(4, async_scheduling=True)
    assert pacer.interval == 4 and not pacer.adaptive
    assert feed(pacer, 0.05, 10, 0.0)[0] == []
    with pytest.raises(ValueError, match="adaptive"):
        StreamPacer.from_setting(-1, True)
    # adaptive needs async scheduling: in lockstep every step waits on the scheduler
    assert not StreamPacer.from_setting(0, async_scheduling=False).adaptive


def test_adaptive_steps_up_while_workers_wait_and_back_down_when_they_do_not():
    pacer = StreamPacer.from_setting(0, async_scheduling=True)
    assert pacer.interval == 1 and pacer.adaptive
    up, t = feed(pacer, 0.005, 4.0, 0.0)  # workers wait 5 ms a step on the scheduler
    assert up == [2, 4, 8, 16] and pacer.interval == MAX_ADAPTIVE_INTERVAL
    down, t = feed(pacer, 0.00005, 20.0, t)  # then hardly at all
    assert down == [8, 4, 2, 1]
    # steps down more slowly than up: the first change came >= 2 s after the gap fell
    pacer = StreamPacer.from_setting(0, True)
    _, t = feed(pacer, 0.005, 0.8, 0.0)
    assert pacer.interval == 2
    changes, _ = feed(pacer, 0.00005, 1.5, t)
    assert all(c >= 2 for c in changes)  # no step down yet (the average lags, may still rise)


def test_adaptive_holds_inside_the_band():
    pacer = StreamPacer.from_setting(0, True)
    _, t = feed(pacer, 0.005, 1.2, 0.0)
    assert pacer.interval > 1
    _, t = feed(pacer, 0.0006, 3, t)  # the moving average settles between the marks...
    level = pacer.interval
    assert feed(pacer, 0.0006, 10, t)[0] == []  # ... and the interval stays
    assert pacer.interval == level
