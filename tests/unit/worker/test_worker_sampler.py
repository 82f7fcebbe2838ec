"""Sampler: greedy fast path, seeds, top-k / top-p / min-p filters, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common.messages import SamplingParams  # noqa: E402
from worker_svc.input_batch import InputBatch  # noqa: E402
from worker_svc.sampler import Sampler, apply_penalties  # noqa: E402

V = 64


def make_batch(params: list[SamplingParams], prompts=None, outputs=None) -> tuple[InputBatch, list]:
    batch = InputBatch(
        max_num_seqs=max(len(params), 1),
        max_model_len=64,
        max_blocks_per_seq=4,
        num_kv_blocks=8,
        vocab_size=V,
        device=torch.device("cpu"),
        max_logprobs=10,
    )
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [1, 2, 3]
        out = outputs[i] if outputs else []
        batch.add(f"r{i}", prompt, out, p, [0], 0)
    rows = np.array([batch.row(f"r{i}") for i in range(len(params))])
    return batch, rows


def sample(params, logits, seed=0, prompts=None, outputs=None):
    batch, rows = make_batch(params, prompts, outputs)
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits.clone(), batch.sampling_metadata(rows))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_argmax_and_skips_sampling_tensors():
    logits = random_logits(5)
    batch, rows = make_batch([SamplingParams(temperature=0.0)] * 5)
    meta = batch.sampling_metadata(rows)
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None
    out = Sampler(torch.Generator())(logits, meta)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_temperature_zero_rows_equal_greedy_in_a_mixed_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5) for i in range(6)]
    out = sample(params, logits).token_ids.tolist()
    for i in range(1, 6, 2):
        assert out[i] == int(logits[i].argmax())


def test_seeded_rows_reproducible_and_independent_of_neighbours():
    target = random_logits(1, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(neighbours: int, seed: int) -> list[int]:
        # the seeded request is row `neighbours` among unseeded rows of other logits
        params = [SamplingParams(temperature=1.0)] * neighbours + [seeded]
        batch, rows = make_batch(params)
        sampler = Sampler(torch.Generator().manual_seed(seed))
        logits = (
            torch.cat([random_logits(neighbours, seed=seed + 1), target]) if neighbours else target
        )
        picks = []
        for _ in range(20):  # one draw per step: the request's generator advances each step
            meta = batch.sampling_metadata(rows)
            picks.append(int(sampler(logits.clone(), meta).token_ids[-1]))
        return picks

    alone = run(0, seed=0)
    assert run(0, seed=99) == alone  # the runner's own generator does not matter
    assert run(3, seed=5) == alone
    assert run(7, seed=11) == alone
    assert len(set(alone)) > 1  # it does sample


def test_unseeded_rows_follow_the_runner_generator():
    logits = random_logits(4)
    params = [SamplingParams(temperature=1.0)] * 4
    a = [sample(params, logits, seed=3).token_ids.tolist() for _ in range(2)]
    assert a[0] == a[1]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=5), "top_k"),
        (SamplingParams(temperature=2.0, top_p=0.5), "top_p"),
        (SamplingParams(temperature=1.0, min_p=0.2), "min_p"),
        (SamplingParams(temperature=1.0, top_k=10, top_p=0.6), "top_k_top_p"),
    ],
)
def test_filters_never_pick_a_filtered_token(params, allowed):
    row = random_logits(1, seed=3)[0]
    n = 2000
    out = sample([params] * n, row.expand(n, V).contiguous(), seed=1).token_ids
    scaled = row / params.temperature
    probs = torch.softmax(scaled, -1)
    if allowed == "min_p":
        keep = torch.nonzero(probs >= params.min_p * probs.max()).flatten()
    else:
        order = scaled.argsort(descending=True)
        keep = order[: params.top_k] if params.top_k else order
        if params.top_p < 1:  # the smallest head of (renormalised) mass >= top_p
            cum = torch.softmax(scaled[keep], -1).cumsum(0)
            keep = keep[: int((cum < params.top_p).sum()) + 1]
    keep = set(keep.tolist())
    picked = set(out.tolist())
    assert picked <= keep, (sorted(picked - keep), sorted(keep))
    assert len(picked) > 1


def test_sampling_follows_the_distribution():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    n = 4000
    out = sample([SamplingParams(temperature=1.0)] * n, row.expand(n, V).contiguous()).token_ids
    freq = torch.bincount(out, minlength=V)[:4].float() / n
    assert torch.allclose(freq, torch.softmax(row, -1)[:4], atol=0.03)


def test_penalties_change_logits_as_defined():
    logits = random_logits(2, seed=4)
    prompt = [[5, 6], [7]]
    outputs = [[6, 9, 9], [3]]
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
        ),
        SamplingParams(temperature=0.0),
    ]
    batch, rows = make_batch(params, prompt, outputs)
    meta = batch.sampling_metadata(rows)
    assert meta.penalty_rows.tolist() == [0]
    got = logits.clone()
    apply_penalties(got, meta)
    want = logits.clone()
    for tok in (5, 6, 9):  # repetition: prompt + output tokens
        v = want[0, tok]
        want[0, tok] = v / 2.0 if v > 0 else v * 2.0
    counts = {6: 1, 9: 2}
    for tok, c in counts.items():  # frequency and presence: output tokens only
        want[0, tok] -= 0.5 * c + 0.25
    assert torch.allclose(got, want)
    # the counts follow tokens appended after a step
    batch.append_tokens(rows[:1], [5])
    meta = batch.sampling_metadata(rows)
    assert meta.output_counts[0, 5] == 1 and meta.output_counts[0, 9] == 2


def test_logprobs_are_raw_logprobs_with_top_n():
    logits = random_logits(2, seed=8)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = sample(params, logits)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(logits[0].argmax())
    assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-5)
    top = ref.topk(3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
