"""Predicted Outputs on a real model in one process (scheduler core + ModelRunner, the tiny
random Llama): greedy output with a prediction equals greedy output without one, whether the
prediction is the output itself, the output with changes, or unrelated tokens, with speculation
off for the server (the prediction alone drafts) and on."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from common.messages import SamplingParams  # noqa: E402
from scheduler_svc.core.speculative import SpeculativeConfig  # noqa: E402
from splitserve.inprocess import InProcessEngine  # noqa: E402
from worker_svc.config import ModelRunnerConfig  # noqa: E402
from worker_svc.model_runner import ModelRunner  # noqa: E402

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=256, warmup_tokens=0
        )
    )


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 14, 5)]


def generate(runner, predictions, spec=None):
    """Greedy outputs of prompts() with these predictions, and the scheduler's stats."""
    runner.reset()
    engine = InProcessEngine(runner, speculative=spec)
    for i, (prompt, prediction) in enumerate(zip(prompts(), predictions, strict=True)):
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, prediction=tuple(prediction)
        )
        engine.add(f"p{i}", prompt, params)
    outputs = engine.run()
    return [outputs[f"p{i}"] for i in range(len(predictions))], engine.scheduler.stats()


def edited(tokens: list[int]) -> list[int]:
    """The output with a changed token every 6 and two dropped: a rewrite's prediction."""
    out = [(t + 1) % 509 + 3 if i % 6 == 5 else t for i, t in enumerate(tokens)]
    del out[12:14]
    return out


def test_greedy_output_with_a_prediction_equals_the_output_without(runner):
    reference, stats = generate(runner, [(), (), ()])
    assert stats.num_spec_draft_tokens == 0  # speculation off, no prediction: no drafts
    assert all(len(r) == MAX_TOKENS for r in reference)

    exact, stats = generate(runner, [reference[0], reference[1], ()])
    assert exact == reference
    assert stats.num_spec_accepted_tokens > 0.9 * stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens >= 50  # of the 2 x 39 tokens after the prefills

    rng = random.Random(3)
    unrelated = [rng.randrange(3, 512) for _ in range(MAX_TOKENS)]
    for spec in (None, SpeculativeConfig(num_speculative_tokens=4)):
        got, stats = generate(runner, [edited(reference[0]), unrelated, reference[2]], spec)
        assert got == reference, spec
        assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
        assert stats.num_free_blocks == stats.num_total_blocks
