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
    picks = torch.max(logits, dim=-1).indices.tolist()  # the greedy rows' verdicts
    temperature = None if meta.all_greedy else meta.temperature
    probs = None if temperature is None else sampler.probabilities(logits.float(), meta)
    out: list[list[int]] = []
    start = 0
    for row_drafts in drafts:
        end = start + len(row_drafts) + 1
        if probs is None or float(temperature[start]) == 0.0:
            out.append(_greedy_prefix(picks[start:end], row_drafts))
        else:
            out.append(_rejection_sample(probs[start:end], row_drafts, meta, start, sampler))
        start = end
    return out


def _greedy_prefix(picks: list[int], drafts: list[int]) -> list[int]:
    """The drafts while each is the argmax before it, then the first argmax that differs (or
    the one after the last draft)."""
    kept = []
    for pick, draft in zip(picks, [*drafts, None], strict=True):
        kept.append(pick)
        if pick != draft:
            break
    return kept


def _uniform(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)


def _rejection_sample(
    probs: torch.Tensor, drafts: list[int], meta: SamplingMetadata, row: int, sampler: Sampler
) -> list[int]:
    generator = meta.generators.get(row, sampler.generator)
    kept: list[int] = []
    for i, draft in enumerate(drafts):
        if float(_uniform(generator)[0]) < float(probs[i, draft]):
            kept.append(draft)
            continue
        residual = probs[i : i + 1].clone()
        residual[0, draft] = 0.0
        if float(residual.sum()) <= 0.0:  # the draft held all the mass: it was accepted above
            kept.append(draft)
            continue
        kept.append(int(_inverse_cdf(residual, _uniform(generator))[0]))
        return kept
    kept.append(int(_inverse_cdf(probs[len(drafts) :], _uniform(generator))[0]))
    return kept
