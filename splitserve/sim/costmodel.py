"""The simulated worker's step time, from what a step computes.

    step_s = base_s + per_token_s * tokens + per_ctx_token_s * attention_pairs + per_seq_s * seqs
             + per swap direction used: swap_latency_s + blocks * kv_bytes_per_block / bandwidth

``attention_pairs`` sums, over every scheduled token, the context it attends to (a chunk of n
tokens after c computed ones: n*c + n*(n+1)/2). The constants come from a calibration profile in
calibration.json, measured on the real runner by bench/sim_calibrate.py (each profile records
the command that produced it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from common.messages import SchedulerOutput
from scheduler_svc.core.preemption_cost import WorkerCosts

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(slots=True)
class StepCostModel:
    base_s: float = 0.01
    per_token_s: float = 1e-4
    per_ctx_token_s: float = 0.0
    per_seq_s: float = 0.0
    swap_bytes_per_s: float = 5e9
    swap_latency_s: float = 1e-4
    kv_bytes_per_block: int = 1 << 20
    name: str = "default"
    description: str = ""
    command: str = ""

    @classmethod
    def load(cls, profile: str | None = None, path: Path | str | None = None) -> StepCostModel:
        """A profile from a calibration file (default: the file's default profile)."""
        data = json.loads(Path(path or CALIBRATION_FILE).read_text())
        name = profile or data["default"]
        try:
            values = data["profiles"][name]
        except KeyError:
            known = ", ".join(sorted(data["profiles"]))
            raise ValueError(f"no calibration profile {name!r}; known: {known}") from None
        names = {f.name for f in fields(cls)}
        return cls(name=name, **{k: v for k, v in values.items() if k in names and k != "name"})

    @staticmethod
    def profiles(path: Path | str | None = None) -> list[str]:
        return sorted(json.loads(Path(path or CALIBRATION_FILE).read_text())["profiles"])

    def compute_s(self, tokens: int, pairs: float, seqs: int) -> float:
        return (
            self.base_s
            + self.per_token_s * tokens
            + self.per_ctx_token_s * pairs
            + self.per_seq_s * seqs
        )

    def swap_s(self, num_blocks: int) -> float:
        if not num_blocks:
            return 0.0
        return self.swap_latency_s + num_blocks * self.kv_bytes_per_block / self.swap_bytes_per_s

    def step_time(self, out: SchedulerOutput) -> float:
        sched = out.num_scheduled_tokens
        pairs = 0
        for new in out.new_requests:
            n, c = sched[new.request_id], new.num_computed_tokens
            pairs += n * c + n * (n + 1) // 2
        for cached in out.cached_requests:
            n, c = sched[cached.request_id], cached.num_computed_tokens
            pairs += n * c + n * (n + 1) // 2
        t = self.swap_s(len(out.blocks_to_swap_out)) + self.swap_s(len(out.blocks_to_swap_in))
        if out.total_num_scheduled_tokens:
            t += self.compute_s(out.total_num_scheduled_tokens, pairs, len(sched))
        return t

    def worker_costs(self) -> WorkerCosts:
        """What a real worker would report for the scheduler's preemption cost model."""
        return WorkerCosts(
            prefill_s_per_token=self.per_token_s,
            prefill_s_per_token_ctx=self.per_ctx_token_s,
            swap_bytes_per_s=self.swap_bytes_per_s,
            swap_latency_s=self.swap_latency_s,
            kv_bytes_per_block=self.kv_bytes_per_block,
        )
