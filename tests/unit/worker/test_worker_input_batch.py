"""The persistent batch applies diffs row by row and keeps preempted requests' tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common.messages import SamplingParams  # noqa: E402
from worker_svc.input_batch import InputBatch  # noqa: E402

P = SamplingParams(temperature=0.0)


def make(rows=4):
    return InputBatch(
        max_num_seqs=rows,
        max_model_len=32,
        max_blocks_per_seq=8,
        num_kv_blocks=16,
        vocab_size=100,
        device=torch.device("cpu"),
        max_logprobs=5,
    )


def tokens(b: InputBatch, req_id: str) -> list[int]:
    row = b.row(req_id)
    return b.token_ids[row, : b.num_tokens[row]].tolist()


def test_add_append_and_untouched_rows():
    b = make()
    b.add("a", [1, 2, 3], [], P, [5], 0)
    b.add("b", [4, 5], [6], P, [7, 8], 2)  # migrated: prompt + earlier output
    row_a = b.row("a")
    before = b.token_ids[row_a].copy()
    b.append_blocks("b", [9])
    b.set_num_computed("b", 3)
    assert b.block_table[b.row("b"), :3].tolist() == [7, 8, 9]
    assert b.num_blocks[b.row("b")] == 3 and b.num_computed[b.row("b")] == 3
    assert tokens(b, "b") == [4, 5, 6]
    assert b.row("a") == row_a and (b.token_ids[row_a] == before).all()
    b.append_tokens(np.array([b.row("a"), b.row("b")]), [10, 11])
    assert tokens(b, "a") == [1, 2, 3, 10] and tokens(b, "b") == [4, 5, 6, 11]


def test_preempt_keeps_tokens_and_resume_replaces_table_and_outputs():
    b = make()
    b.add("a", [1, 2, 3], [], P, [5, 6], 3)
    b.append_tokens(np.array([b.row("a")]), [40])
    b.preempt("a")
    with pytest.raises(KeyError, match="preempted"):
        b.row("a")
    b.add("c", [7], [], P, [5], 0)  # takes the freed row
    b.resume("a", [1, 2], 0, [40, 41])  # the scheduler's copy of the outputs wins
    assert tokens(b, "a") == [1, 2, 3, 40, 41]
    assert b.block_table[b.row("a"), :2].tolist() == [1, 2] and b.num_blocks[b.row("a")] == 2
    assert b.num_computed[b.row("a")] == 0


def test_resume_of_a_request_still_in_the_batch_and_remove():
    b = make()
    b.add("a", [1, 2], [3], P, [1], 1)
    b.resume("a", [4, 5], 2, [3])
    assert tokens(b, "a") == [1, 2, 3] and b.block_table[b.row("a"), :2].tolist() == [4, 5]
    b.remove("a")
    b.remove("never-seen")  # finished ids the worker never got are ignored
    assert not b.states and len(b.free_rows) == 4
    with pytest.raises(KeyError, match="unknown request"):
        b.row("a")


def test_rows_are_reused_and_full_batch_is_an_error():
    b = make(rows=2)
    b.add("a", [1], [], P, [], 0)
    b.add("b", [1], [], P, [], 0)
    with pytest.raises(ValueError, match="full"):
        b.add("c", [1], [], P, [], 0)
    b.remove("a")
    b.add("c", [1], [], P, [], 0)
    b.clear()
    assert not b.states


@pytest.mark.parametrize(
    ("prompt", "blocks", "computed", "match"),
    [
        ([1] * 33, [], 0, "max_model_len"),
        ([100], [], 0, "vocabulary"),
        ([1], [16], 0, "KV cache"),
        ([1], list(range(9)), 0, "max_model_len"),
        ([1, 2], [0], 3, "num_computed"),
    ],
)
def test_invalid_requests_are_rejected(prompt, blocks, computed, match):
    with pytest.raises(ValueError, match=match):
        make().add("a", prompt, [], P, blocks, computed)


def test_sampling_metadata_only_builds_what_is_used():
    b = make()
    b.add("g", [1], [], P, [], 0)
    b.add("t", [1], [], SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2), [], 0)
    rows = np.array([b.row("g"), b.row("t")])
    meta = b.sampling_metadata(rows)
    assert not meta.all_greedy
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert meta.top_k is None and meta.min_p is None and meta.penalty_rows is None
    assert meta.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert list(meta.generators) == [1]
    assert meta.num_logprobs == [None, 2]
    with pytest.raises(ValueError, match="logprobs"):
        b.add("x", [1], [], SamplingParams(logprobs=6), [], 0)


def test_held_requests_are_the_rows_with_their_tables_not_the_preempted():
    b = make()
    b.add("a", [1, 2, 3], [4], P, [5, 6], 3)
    b.add("b", [7, 8], [], P, [9], 0)
    b.add("c", [1], [], P, [10], 0)
    b.append_blocks("a", [11])
    b.num_computed[b.row("a")] += 1  # a step computed token 3
    b.preempt("b")
    b.remove("c")
    assert b.held_requests() == [("a", [5, 6, 11], 4, 4)]
    b.clear()
    assert b.held_requests() == []
