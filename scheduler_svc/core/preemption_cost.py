"""What preempting a running request costs, under recompute and under swap.

recompute: the victim's computed tokens are computed again when it is readmitted, except its
  leading blocks other running requests share (they stay cached: a prefix hit). A prefill of
  tokens [h, c) costs ``(c - h) * prefill_s_per_token`` plus attention,
  ``prefill_s_per_token_ctx * (c^2 - h^2) / 2`` (each token attends to those before it).
swap: its KV blocks are copied to host memory and back: ``2 * (swap_latency_s +
  blocks * kv_bytes_per_block / swap_bytes_per_s)``.

The worker measures these numbers when it starts (worker_svc/cost_probe.py) and reports them in
its registration. Short contexts make recompute cheaper (its cost grows with the square of the
context, swap's linearly plus a fixed latency); long ones swap. ``auto`` takes the cheaper per
victim, falling back to recompute when the host pool is full; without measurements it swaps
victims of at least ``auto_swap_min_tokens`` computed tokens. ``waste(request)`` is the cost of
the action that would be taken; policies break victim ties with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.request import Request


@dataclass(slots=True, frozen=True)
class WorkerCosts:
    """A worker's measured costs; 0 = not measured."""

    prefill_s_per_token: float = 0.0
    prefill_s_per_token_ctx: float = 0.0  # attention: per token, per token of context before it
    swap_bytes_per_s: float = 0.0  # device <-> host copy bandwidth (one direction)
    swap_latency_s: float = 0.0  # fixed cost of one copy call
    kv_bytes_per_block: int = 0
    # speculative decoding: seconds of a step of 1, 2, 4, ... tokens (cost_probe.py)
    verify_step_s: tuple[float, ...] = ()

    @property
    def known(self) -> bool:
        return (
            self.prefill_s_per_token > 0
            and self.swap_bytes_per_s > 0
            and self.kv_bytes_per_block > 0
        )

    @classmethod
    def from_message(cls, msg: Any) -> WorkerCosts | None:
        """From anything with these attributes (e.g. the worker's Register message); None when
        nothing was measured."""
        costs = cls(
            prefill_s_per_token=float(getattr(msg, "prefill_s_per_token", 0.0) or 0.0),
            prefill_s_per_token_ctx=float(getattr(msg, "prefill_s_per_token_ctx", 0.0) or 0.0),
            swap_bytes_per_s=float(getattr(msg, "swap_bytes_per_s", 0.0) or 0.0),
            swap_latency_s=float(getattr(msg, "swap_latency_s", 0.0) or 0.0),
            kv_bytes_per_block=int(getattr(msg, "kv_bytes_per_block", 0) or 0),
            verify_step_s=tuple(float(t) for t in getattr(msg, "verify_step_s", ()) or ()),
        )
        return costs if costs != cls() else None


class PreemptionCostModel:
    def __init__(
        self,
        kv: KVCacheManager,
        mode: str,
        costs: WorkerCosts | None = None,
        auto_swap_min_tokens: int = 512,
    ) -> None:
        self.kv = kv
        self.mode = mode
        self.costs = costs if costs is not None else WorkerCosts()
        self.auto_swap_min_tokens = auto_swap_min_tokens

    def recompute_span(self, request: Request) -> tuple[int, int]:
        """(h, c): tokens [h, c) would be computed again; [0, h) are blocks shared with other
        running requests, which stay cached."""
        kv = self.kv
        c = request.num_computed_tokens
        h = 0
        if kv.enable_caching:
            shared = 0
            for block in kv.req_blocks.get(request.request_id, ()):
                if block.ref_cnt < 2 or block.block_hash is None:
                    break
                shared += 1
            bs = kv.block_size
            h = min(shared * bs, (request.num_tokens - 1) // bs * bs, c)
        return h, c

    def recompute_s(self, request: Request) -> float:
        h, c = self.recompute_span(request)
        costs = self.costs
        return (c - h) * costs.prefill_s_per_token + costs.prefill_s_per_token_ctx * (
            c * c - h * h
        ) / 2

    def swap_blocks(self, request: Request) -> int:
        return -(-request.num_computed_tokens // self.kv.block_size)

    def swap_s(self, request: Request) -> float:
        costs = self.costs
        if costs.swap_bytes_per_s <= 0:
            return float("inf")
        one_way = self.swap_blocks(request) * costs.kv_bytes_per_block / costs.swap_bytes_per_s
        return 2 * (costs.swap_latency_s + one_way)

    def prefers_swap(self, request: Request) -> bool:
        """Would this victim be swapped (host room permitting)?"""
        mode = self.mode
        if mode == "swap":
            return True
        if mode != "auto":
            return False
        if self.costs.known:
            return self.swap_s(request) < self.recompute_s(request)
        return request.num_computed_tokens >= self.auto_swap_min_tokens

    def waste(self, request: Request) -> float:
        """Work lost per KV block preempting it frees, for the action that would be taken
        (seconds when the worker's costs are known, else tokens). Blocks shared with other
        running requests free nothing and cost nothing to recompute."""
        kv = self.kv
        blocks = kv.req_blocks.get(request.request_id, ())
        freed = sum(1 for b in blocks if b.ref_cnt < 2)
        if not freed:
            return float("inf")  # frees nothing
        swap = (
            self.mode != "recompute"
            and self.prefers_swap(request)
            and self.swap_blocks(request) <= kv.host_pool.num_free_blocks
        )
        if self.costs.known:
            lost = self.swap_s(request) if swap else self.recompute_s(request)
        elif swap:
            lost = float(request.num_computed_tokens)
        else:
            h, c = self.recompute_span(request)
            lost = float(c - h)
        return lost / freed
