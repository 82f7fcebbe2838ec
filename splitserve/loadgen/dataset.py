"""The synthetic dataset: prompts of random vocabulary token ids (so their lengths are exact)
with fixed, uniform or long-tailed (lognormal) prompt and output length distributions."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def sample_lengths(
    rng: random.Random, n: int, mean: int, dist: str, range_ratio: float, sigma: float, cap: int
) -> list[int]:
    """n lengths >= 1 with this mean: fixed, uniform in [mean(1-r), mean(1+r)], or lognormal
    with this mean and shape sigma (long-tailed), all clipped to [1, cap]."""
    if mean < 1:
        raise ValueError(f"a mean length must be >= 1; got {mean}")
    if dist == "fixed":
        values = [mean] * n
    elif dist == "uniform":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1); got {range_ratio}")
        lo = max(1, math.floor(mean * (1 - range_ratio)))
        hi = max(lo, math.ceil(mean * (1 + range_ratio)))
        values = [rng.randint(lo, hi) for _ in range(n)]
    elif dist == "lognormal":
        if sigma <= 0:
            raise ValueError(f"--sigma must be > 0; got {sigma}")
        mu = math.log(mean) - sigma * sigma / 2  # E[X] = exp(mu + sigma^2 / 2) = mean
        values = [round(rng.lognormvariate(mu, sigma)) for _ in range(n)]
    else:
        raise ValueError(f"unknown length distribution {dist!r}; one of {DISTRIBUTIONS}")
    return [min(cap, max(1, v)) for v in values]


def token_pool(tokenizer_name: str | None, vocab_size: int | None) -> list[int]:
    """Token ids to draw prompts from: the vocabulary without special/added tokens."""
    if vocab_size:
        return list(range(min(1000, vocab_size // 2), vocab_size))
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_name)
    special = set(tok.backend.get_added_tokens_decoder())
    return [i for i in range(tok.vocab_size) if i not in special]


def synthetic_requests(args: argparse.Namespace, pool: list[int]) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    ins = sample_lengths(
        rng,
        n,
        args.input_len,
        args.input_dist,
        args.range_ratio,
        args.sigma,
        args.max_input_len or 4 * args.input_len,
    )
    outs = sample_lengths(
        rng,
        n,
        args.output_len,
        args.output_dist,
        args.range_ratio,
        args.sigma,
        args.max_output_len or 4 * args.output_len,
    )
    prefix = [rng.choice(pool) for _ in range(args.shared_prefix_len)]
    return [
        BenchRequest(prefix + [rng.choice(pool) for _ in range(i)], o)
        for i, o in zip(ins, outs, strict=True)
    ]
