"""The grouped low-rank product in torch (any device): the reference backend's, and the one the
native kernel (native_lora.py, csrc/lora.c) is tested against.

    out_p += scale[slot, p] * (x @ A[slot, p]^T) @ B[slot, p]     for each token, its slot

As two dense products over the step's slots [0, n): the shrink of every token by every slot's A
([T, n * parts * rank], one GEMM), zeroed outside each token's own slot (and scaled) by a
one-hot mask, then each part's expand by all n slots' B stacked ([n * rank, out], one GEMM). Its
cost grows with n, but it is a fixed handful of ops per site whatever the grouping, where a
product per adapter group costs a dispatch per group. The delta is float32 (PEFT computes it in
float32 under a bfloat16 model) and added to the projection's output in place, rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.lora.adapter_slots import SiteSlots
from worker_svc.lora.step_lora import StepLora


def add_lora_(
    x: torch.Tensor, outs: tuple[torch.Tensor, ...], site: SiteSlots, step: StepLora
) -> None:
    """outs[p] [T, out_p] += the adapters' deltas of x [T, in] (outs in place: views allowed)."""
    n, parts, rank = step.num_slots, len(outs), site.max_rank
    tokens = x.shape[0]
    shrunk = F.linear(x.float(), site.a[:n].view(n * parts * rank, -1))
    mask = step.one_hot()[:, :, None] * site.scale[:n]  # [T, n, parts]
    shrunk = shrunk.view(tokens, n, parts, rank) * mask[..., None]
    for p, out in enumerate(outs):
        part = shrunk[:, :, p].reshape(tokens, n * rank)
        out.add_(part @ site.b[p][:n].view(n * rank, -1))
