"""Errors the scheduler core raises, each carrying a sentence a user can act on."""

from __future__ import annotations

from common.outcomes import RequestRejected

__all__ = ["RequestRejected", "SchedulerConfigError"]


class SchedulerConfigError(ValueError):
    """A SchedulerConfig field is out of range or names something unknown."""
