"""Speculative decoding, the worker's half: score a request's drafted tokens in the step's one
forward pass and keep the prefix its own sampling agrees with.

A request with drafts d_1..d_k (the scheduler's, scheduler_svc/core/speculative.py) runs k + 1
positions: its last known token and the drafts. The logits at position i give p_i, the model's
distribution for the token after d_1..d_i. Verification walks i = 0..k-1:
- greedy: d_{i+1} is kept while it is argmax p_i; the first mismatch is replaced by argmax p_i,
  so the tokens are exactly what decoding one token at a time gives;
- sampling (temperature, top-k, top-p, min-p as the sampler applies them): the drafts are
  deterministic proposals (q = 1 on the drafted token), so d_{i+1} is kept with probability
  p_i(d_{i+1}); on a rejection the token is drawn from p_i with d_{i+1} removed, renormalized.
  That is rejection sampling: every emitted token is distributed as p_i exactly.
When every draft is kept, one more token comes from p_k. A request thus gets 1 to k + 1 tokens.
"""

from __future__ import annotations

import torch

from worker_svc.sampler import Sampler, SamplingMetadata, _inverse_cdf


def verify(
    logits: torch.Tensor,  # [sum(k + 1), V]: each spec request's positions, in order
    drafts: list[list[int]],
    meta: SamplingMetadata,  # one row per position (the request's parameters repeated)
    sampler: Sampler,
) -> list[list[int]]:
    """The tokens each request keeps (accepted drafts, then one token of its own)."""
    out: list[list[int]] = []
    greedy_rows = meta.all_greedy or meta.temperature is None
    if greedy_rows:
        targets = torch.max(logits, dim=-1).indices.tolist()
        probs = None
    else:
        probs = sampler.probabilities(logits.float(), meta)
        targets = None
    start = 0
    for row_drafts in drafts:
        k = len(row_drafts)
        if targets is not None or _is_greedy(meta, start):
            picks = targets[start : start + k + 1] if targets is not None else None
            if picks is None:
                picks = torch.max(logits[start : start + k + 1], dim=-1).indices.tolist()
            kept = []
            for i in range(k + 1):
                kept.append(picks[i])
                if i == k or picks[i] != row_drafts[i]:
                    break
        else:
            kept = _rejection_sample(probs[start : start + k + 1], row_drafts, meta, start, sampler)
        out.append(kept)
        start += k + 1
    return out


def _is_greedy(meta: SamplingMetadata, row: int) -> bool:
    return meta.temperature is not None and float(meta.temperature[row]) == 0.0


def _rejection_sample(
    probs: torch.Tensor, drafts: list[int], meta: SamplingMetadata, row: int, sampler: Sampler
) -> list[int]:
    generator = meta.generators.get(row, sampler.generator)
    kept: list[int] = []
    for i, draft in enumerate(drafts):
        u = float(
            torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)[0]
        )
        if u < float(probs[i, draft]):
            kept.append(draft)
            continue
        residual = probs[i : i + 1].clone()
        residual[0, draft] = 0.0
        if float(residual.sum()) <= 0.0:  # the draft held all the mass: it was accepted above
            kept.append(draft)
            continue
        v = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
        kept.append(int(_inverse_cdf(residual, v)[0]))
        return kept
    v = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
    kept.append(int(_inverse_cdf(probs[len(drafts) : len(drafts) + 1], v)[0]))
    return kept
