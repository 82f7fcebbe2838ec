"""The requests every system gets: token-id prompts, output length, arrival times."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

W64_PATH = (
    Path(__file__).resolve().parents[1] / "workloads" / "w64.json"
)  # copy of shared/workloads


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int  # every request generates exactly this many tokens (EOS ignored)
    note: str

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def describe(self) -> str:
        lens = sorted(self.prompt_lens)
        mid = lens[len(lens) // 2]
        return (
            f"{self.name}: {self.num_requests} requests, prompts {lens[0]}-{lens[-1]} tokens "
            f"(median {mid}, total {sum(lens)}), {self.max_tokens} output tokens each, EOS ignored"
        )


def synthetic(
    n: int, max_tokens: int, mean: int, sigma: float, lo: int, hi: int, seed: int
) -> Workload:
    """Long-tailed prompts: lognormal lengths with this mean, clipped to [lo, hi]; token ids drawn
    from the SmolLM2 vocabulary without special tokens (bench serve's pool), seeded."""
    from splitserve.loadgen import sample_lengths, token_pool

    rng = random.Random(seed)
    lens = [max(lo, x) for x in sample_lengths(rng, n, mean, "lognormal", 0.0, sigma, hi)]
    pool = token_pool(None, None)
    prompts = [[rng.choice(pool) for _ in range(k)] for k in lens]
    note = f"lognormal prompt lengths (mean {mean}, sigma {sigma}) in [{lo}, {hi}], seed {seed}"
    return Workload(f"synthetic-{n}x{max_tokens}", prompts, max_tokens, note)


def w64(path: Path = W64_PATH, n: int | None = None) -> Workload:
    data = json.loads(Path(path).read_text())
    prompts = data["prompts"][:n] if n else data["prompts"]
    return Workload(
        data.get("name", "W64"), prompts, int(data.get("max_tokens", 64)), data.get("note", "")
    )


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: all at 0 for rate inf, else a
    Poisson process (the first at 0), the same gaps `splitserve bench serve` draws."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    out, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        out.append(t)
    return out
