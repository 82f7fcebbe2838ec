"""Speculative decoding end to end in one process: the scheduler core drafts, the ModelRunner
verifies. Greedy output with drafts equals greedy output without them (whatever the drafts:
right, wrong, partly right), rejected drafts leave the block pool whole, and with sampling the
first token's distribution is the model's (a chi-square test over many seeded draws).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from common.messages import SamplingParams  # noqa: E402
from scheduler_svc.core import Request, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.core.speculative import NgramProposer, SpeculativeConfig  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=NUM_BLOCKS, warmup_tokens=0
        )
    )


def serve(runner, prompts, params, spec=None, proposer=None):
    """Run the requests to the end through a Scheduler and the runner; their output tokens and
    the scheduler (for its stats and blocks)."""
    runner.reset()
    cfg = SchedulerConfig(block_size=4, num_blocks=NUM_BLOCKS, max_model_len=512, speculative=spec)
    sched = Scheduler(cfg)
    if proposer is not None:
        sched._proposer = proposer  # noqa: SLF001
    reqs = [Request(f"r{i}", p, params, eos_token_id=None) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        result = runner.execute_model(out)
        sched.update_from_output(out, result.sampled_token_ids)
    runner.execute_model(sched.schedule())  # the finished ids reach the worker
    return {r.request_id: r.output_token_ids for r in reqs}, sched


class Oracle:
    """Drafts the reference continuation, with every `wrong`-th draft replaced by a wrong
    token: verification must keep exactly the right prefix."""

    def __init__(self, reference: dict[str, list[int]], k: int, wrong: int) -> None:
        self.reference, self.k, self.wrong = reference, k, wrong
        self.drafted = self.accepted = 0

    def wants(self, request):
        return True

    active = wants

    def propose(self, request, max_tokens):
        done = len(request.output_token_ids)
        right = self.reference[request.request_id][done : done + min(self.k, max_tokens)]
        return [
            (t + 1) % 512 if (done + i) % self.wrong == self.wrong - 1 else t
            for i, t in enumerate(right)
        ]

    def record(self, request, num_drafted, num_accepted):
        self.drafted += num_drafted
        self.accepted += num_accepted

    def forget(self, request_id):
        """Nothing kept per request."""


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, 512) for _ in range(6)]
    return [base * 3, [rng.randrange(3, 512) for _ in range(11)], base + base[:3]]


def test_greedy_with_drafts_equals_greedy_without(runner):
    reference, _ = serve(runner, prompts(), GREEDY)
    spec = SpeculativeConfig(num_speculative_tokens=4)
    for wrong in (1000, 3, 1):  # all right, every third wrong, all wrong
        oracle = Oracle(reference, 4, wrong)
        got, sched = serve(runner, prompts(), GREEDY, spec, oracle)
        assert got == reference, wrong
        stats = sched.stats()
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_used_blocks == 0
        assert stats.num_recomputed_tokens == 0  # rejected positions are not recompute
        assert stats.num_spec_draft_tokens == oracle.drafted > 0
        assert stats.num_spec_accepted_tokens == oracle.accepted
        if wrong == 1:
            assert oracle.accepted == 0
        if wrong == 1000:  # everything accepted: far fewer steps than tokens
            assert oracle.accepted > oracle.drafted * 0.9
            assert stats.num_steps < 3 * 24 / 2


def test_verification_as_decode_rows_equals_one_chunk(runner, monkeypatch):
    """With the native decode kernel a verification's 1 + k tokens run as 1 + k decode rows
    over the request's block table (past MAX_VERIFY_ROW_READS as one chunk): both layouts keep
    the greedy output, and each is the one taken."""
    if runner.ops.attention_kernel is None:
        pytest.skip("no native decode kernel at this CPU level: verifications are chunks")
    import worker_svc.model_runner as model_runner_module
    from worker_svc import step_inputs

    layouts: list[tuple[int, int]] = []  # per step with drafts: (decode rows, tokens)

    def recording(parts, so):
        inputs = step_inputs.prepare_inputs(parts, so)
        if so.spec_token_ids:
            layouts.append((inputs.meta.num_native_decodes, len(inputs.input_ids)))
        return inputs

    monkeypatch.setattr(model_runner_module, "prepare_inputs", recording)
    reference, _ = serve(runner, prompts(), GREEDY)
    spec = SpeculativeConfig(num_speculative_tokens=4)
    for bound, as_rows in ((step_inputs.MAX_VERIFY_ROW_READS, True), (0, False)):
        monkeypatch.setattr(step_inputs, "MAX_VERIFY_ROW_READS", bound)
        layouts.clear()
        got, sched = serve(runner, prompts(), GREEDY, spec, Oracle(reference, 4, 3))
        assert got == reference, bound
        assert sched.stats().num_free_blocks == NUM_BLOCKS
        assert layouts
        rows_steps = [rows == tokens for rows, tokens in layouts]
        assert all(rows_steps) if as_rows else not any(rows_steps), layouts


def test_ngram_drafting_keeps_greedy_output(runner):
    base = prompts(1)
    first, _ = serve(runner, base, GREEDY)
    # each prompt, its own continuation, the prompt again: the lookup drafts that continuation
    looped = [p + first[f"r{i}"] + p for i, p in enumerate(base)]
    reference, _ = serve(runner, looped, GREEDY)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    got, sched = serve(runner, looped, GREEDY, spec)
    assert got == reference
    assert sched.stats().num_spec_draft_tokens > 0
    assert sched.stats().num_free_blocks == NUM_BLOCKS


def test_ngram_proposer_finds_the_latest_earlier_occurrence():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    req = Request("r", [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2], SamplingParams())
    assert proposer.propose(req, 3) == [3, 7, 8]  # "1 2" last seen before the suffix at 5..7
    req.output_token_ids.append(3)  # suffix "1 2 3": the latest earlier one is at 5..8
    assert proposer.propose(req, 4) == [7, 8, 5, 1]
    req.output_token_ids.append(4)  # "3 4", "2 3 4" never seen
    assert proposer.propose(req, 2) == []


# chi-square critical value, 7 degrees of freedom, alpha = 0.001
CHI2_CRITICAL_7 = 24.32


def test_rejection_sampling_draws_from_the_model_distribution(runner, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 99, 230, 41, 8]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / 2.0, dim=-1)
    top = torch.argsort(p, descending=True)[:7].tolist()
    draft = top[1]  # often accepted, often rejected

    class Fixed:
        def wants(self, request):
            return True

        active = wants

        def propose(self, request, max_tokens):
            return [draft] if not request.output_token_ids else []

        def record(self, *args):
            """Nothing to learn from: it always drafts the same token."""

        def forget(self, request_id):
            """Nothing kept per request."""

    params = SamplingParams(temperature=2.0, max_tokens=2, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=1)
    torch.manual_seed(0)
    runner.sampler.generator.manual_seed(1234)
    trials = 1500
    firsts: list[int] = []
    for _ in range(0, trials, 50):  # 50 requests a batch, each drafting `draft`
        got, _ = serve(runner, [prompt] * 50, params, spec, Fixed())
        firsts += [toks[0] for toks in got.values()]
    counts = [sum(t == k for t in firsts) for k in top] + [sum(t not in top for t in firsts)]
    expected = [float(p[k]) * trials for k in top] + [float(1 - p[top].sum()) * trials]
    assert min(expected) >= 5
    chi2 = sum((o - e) ** 2 / e for o, e in zip(counts, expected, strict=True))
    assert chi2 < CHI2_CRITICAL_7, (counts, [round(e) for e in expected])
