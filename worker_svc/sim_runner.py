"""A worker runner with no model: it answers each step after a modelled forward time.

For scale benchmarks and mechanics tests. Its "model" is deterministic: the next token is a
hash of the request's last tokens, so a run can be checked token for token against another
run, whatever the batching, preemption or migration. A request with structured output takes the
token its grammar allows that the same hash picks (worker_svc/structured_output.py, loaded at the
first such request: the scheduler image, which also imports this module, has no numpy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.messages import SchedulerOutput, StructuredOutput
from common.model_source import read_vocab_size, resolve_model


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class SimConfig:
    simulate: bool = _opt(False, "run a simulated model (no weights): for scale tests")
    sim_step_base_ms: float = _opt(5.0, "simulated forward time per step")
    sim_step_per_token_us: float = _opt(50.0, "simulated forward time per scheduled token")
    sim_num_blocks: int = _opt(4096, "simulated KV cache blocks")
    sim_vocab_size: int = _opt(
        0, "simulated vocabulary size; 0: the model's own (the scheduler refuses any other)"
    )


def sim_next_token(
    history: list[int], vocab_size: int, allowed: Sequence[int] | None = None
) -> int:
    """The simulated model's next token; one of `allowed` (ascending ids) when given."""
    h = 0x9E3779B1
    for tok in history[-6:]:
        h = ((h ^ tok) * 0x01000193) & 0xFFFFFFFF
    if allowed is not None:
        return int(allowed[h % len(allowed)])
    return 3 + h % (vocab_size - 3)  # never 0..2 (special tokens, EOS)


@dataclass(slots=True)
class SimOutput:
    sampled_token_ids: dict[str, list[int]]
    logprobs: None = None
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0


class SimRunner:
    def __init__(
        self,
        sim: SimConfig,
        model: str | None = None,
        block_size: int = 16,
        max_model_len: int = 8192,
    ) -> None:
        self.sim = sim
        self.source = resolve_model(model)
        self.model_name = self.source.name
        self.block_size = block_size
        self.num_blocks = sim.sim_num_blocks
        self.num_host_blocks = 0
        self.max_model_len = max_model_len
        self.vocab_size = sim.sim_vocab_size or read_vocab_size(self.source)
        self.eos_token_id = 2
        self.device = "sim"
        self.dtype = "none"
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}  # block tables, for held_requests()
        self.computed: dict[str, int] = {}
        self.preempted: set[str] = set()  # no row while preempted (or swapped out)
        self.constraints: dict[str, StructuredOutput] = {}
        self.structured = None  # a StructuredOutputs from the first constrained request on

    def _structured(self):
        if self.structured is None:
            from common.tokenizer import load_tokenizer
            from worker_svc.structured_output import StructuredOutputs

            self.structured = StructuredOutputs(
                lambda: load_tokenizer(self.source), self.vocab_size, self.eos_token_id
            )
        return self.structured

    def reset(self) -> None:
        self.prompts.clear()
        self.tokens.clear()
        self.tables.clear()
        self.computed.clear()
        self.preempted.clear()
        self.constraints.clear()
        if self.structured is not None:
            self.structured.clear()

    def held_requests(self) -> list[tuple[str, list[int], int, int]]:
        """Per row: (request key, block ids, num computed tokens, num tokens)."""
        return [
            (rid, list(self.tables[rid]), self.computed[rid], len(tokens))
            for rid, tokens in self.tokens.items()
            if rid not in self.preempted
        ]

    def execute_model(self, so: SchedulerOutput) -> SimOutput:
        started = time.perf_counter()
        tables, computed, preempted = self.tables, self.computed, self.preempted
        for rid in so.finished_req_ids:
            self.prompts.pop(rid, None)
            self.tokens.pop(rid, None)
            tables.pop(rid, None)
            computed.pop(rid, None)
            preempted.discard(rid)
            if self.constraints.pop(rid, None) is not None:
                self.structured.remove(rid)
        preempted.update(r for r in so.preempted_req_ids if r in self.tokens)
        for new in so.new_requests:
            rid = new.request_id
            self.prompts[rid] = list(new.prompt_token_ids)
            self.tokens[rid] = list(new.prompt_token_ids) + list(new.output_token_ids)
            computed[rid] = new.num_computed_tokens
            tables[rid] = list(new.block_ids)
            preempted.discard(rid)
            structured = new.sampling_params.structured
            was_constrained = self.constraints.pop(rid, None) is not None
            if structured is not None:
                self.constraints[rid] = structured
            if structured is not None or was_constrained:
                self._structured().add(rid, structured, new.output_token_ids)
        for cached in so.cached_requests:
            rid = cached.request_id
            computed[rid] = cached.num_computed_tokens
            if cached.resumed:
                self.tokens[rid] = self.prompts[rid] + list(cached.new_token_ids)
                tables[rid] = list(cached.new_block_ids)
                preempted.discard(rid)
                if rid in self.constraints:
                    self.structured.add(rid, self.constraints[rid], cached.new_token_ids)
            elif cached.new_block_ids:
                tables[rid].extend(cached.new_block_ids)
        sampled: dict[str, list[int]] = {}
        sampling: list[str] = []
        for rid, n in so.num_scheduled_tokens.items():
            c = computed[rid] = computed[rid] + n
            sampled[rid] = []
            if c >= len(self.tokens[rid]):
                sampling.append(rid)
        allowed = self._allowed(sampling)
        vocab = self.vocab_size
        for rid in sampling:
            seq = self.tokens[rid]
            tok = sim_next_token(seq, vocab, allowed.get(rid))
            seq.append(tok)
            sampled[rid].append(tok)
        if allowed:
            self.structured.advance(sampling, [sampled[rid][0] for rid in sampling])
        if so.total_num_scheduled_tokens:
            modelled = (
                self.sim.sim_step_base_ms / 1e3
                + so.total_num_scheduled_tokens * self.sim.sim_step_per_token_us / 1e6
            )
            remaining = modelled - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return SimOutput(sampled, None, time.perf_counter() - started, 0.0)

    def _allowed(self, sampling: list[str]) -> dict:
        """Request id -> the token ids its grammar allows now, for the constrained ones."""
        if self.structured is None or not self.structured.active:
            return {}
        from worker_svc.structured_output import allowed_token_ids

        picked = self.structured.masks(sampling)
        if picked is None:
            return {}
        positions, masks = picked
        return {
            sampling[i]: allowed_token_ids(mask, self.vocab_size)
            for i, mask in zip(positions, masks, strict=True)
        }
