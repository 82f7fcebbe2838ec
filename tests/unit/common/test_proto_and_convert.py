"""The generated code matches the .proto files; the step diff survives the wire both ways."""

import filecmp
import subprocess
import sys
from pathlib import Path

from common.convert import (
    HandleTable,
    decode_step,
    decode_step_result,
    encode_step,
    encode_step_result,
    sampling_from_proto,
    sampling_to_proto,
)
from scheduler_svc.core import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_not_stale(tmp_path):
    protos = sorted(p.name for p in (ROOT / "proto").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-Icommon/pb={ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *[f"common/pb/{p}" for p in protos],
        ],
        check=True,
        cwd=ROOT,
    )
    generated = sorted(p.name for p in (tmp_path / "common" / "pb").iterdir())
    assert generated, "protoc produced nothing"
    for name in generated:
        assert filecmp.cmp(
            tmp_path / "common" / "pb" / name, ROOT / "common" / "pb" / name, shallow=False
        ), f"common/pb/{name} is stale: run `make proto`"


def test_sampling_roundtrip():
    params = SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=123,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        stop_token_ids=[3, 4],
        ignore_eos=True,
        logprobs=2,
    )
    back, stop = sampling_from_proto(sampling_to_proto(params, ["x"]))
    assert back == params and stop == ["x"]


def test_unset_proto_fields_take_defaults():
    from common.pb import sampling_pb2

    params, stop = sampling_from_proto(sampling_pb2.SamplingParams())
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0
    assert params.seed is None and params.logprobs is None and stop == []


def test_step_roundtrip_and_handles():
    handles = HandleTable()
    p = SamplingParams(max_tokens=4, temperature=0.0)
    out = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], p, [0, 1], 0, [])],
        cached_requests=[],
        num_scheduled_tokens={"a": 3},
        total_num_scheduled_tokens=3,
        step_id=1,
    )
    step = encode_step(out, handles)
    back = decode_step(step)
    ha = handles.by_id["a"]
    assert back.new_requests[0].request_id == str(ha)
    assert back.new_requests[0].prompt_token_ids == [1, 2, 3]
    assert back.num_scheduled_tokens == {str(ha): 3}
    # a decode step costs a few bytes per request
    out2 = SchedulerOutput(
        cached_requests=[CachedRequestData("a", [], 3)],
        num_scheduled_tokens={"a": 1},
        total_num_scheduled_tokens=1,
        step_id=2,
    )
    step2 = encode_step(out2, handles)
    assert step2.ByteSize() <= 16
    back2 = decode_step(step2)
    assert back2.cached_requests[0].num_computed_tokens == 3
    # results map handles back to ids
    result = encode_step_result(2, {str(ha): [9]})
    sampled, _ = decode_step_result(result, handles)
    assert sampled == {"a": [9]}
    # finishing releases the handle for reuse
    out3 = SchedulerOutput(finished_req_ids={"a"}, step_id=3)
    step3 = encode_step(out3, handles)
    assert list(step3.finished) == [ha] and "a" not in handles.by_id
    assert handles.assign("b") == ha


def test_unknown_handle_in_result_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="unknown request handle"):
        decode_step_result(encode_step_result(1, {"77": [1]}), HandleTable())


def test_result_tokens_checked_against_the_vocabulary():
    import pytest

    handles = HandleTable()
    ha, hb = str(handles.assign("a")), str(handles.assign("b"))
    ok = encode_step_result(1, {ha: [99], hb: []})
    assert decode_step_result(ok, handles, 100)[0] == {"a": [99], "b": []}
    for sampled in ({ha: [100]}, {ha: [2**31]}, {hb: [1, 2]}):
        with pytest.raises(ValueError, match="at most one token below the vocabulary size 100"):
            decode_step_result(encode_step_result(1, sampled), handles, 100)
    assert decode_step_result(encode_step_result(1, {hb: [1, 2]}), handles)[0] == {"b": [1, 2]}


def test_a_decode_step_travels_in_columns():
    """Running requests go as packed columns (a few bytes each, new block ids only where a
    block boundary is crossed); resumed ones as messages; both come back as they went."""
    import pytest

    handles = HandleTable()
    ids = [f"r{i}" for i in range(256)]
    for rid in ids:
        handles.assign(rid)
    cached = [
        CachedRequestData(rid, [1000 + i] if i % 16 == 0 else [], 100 + i)
        for i, rid in enumerate(ids)
    ]
    cached.append(CachedRequestData(ids[3], [7, 8], 40, True, [5, 6]))  # resumed: singly
    out = SchedulerOutput(
        cached_requests=cached,
        num_scheduled_tokens={rid: 1 for rid in ids},
        total_num_scheduled_tokens=256,
        step_id=9,
    )
    step = encode_step(out, handles)
    assert len(step.running.handles) == 256 and len(step.cached_requests) == 1
    assert step.ByteSize() < 256 * 6
    back = decode_step(step)
    by_id = {c.request_id: c for c in back.cached_requests if not c.resumed}
    for i, rid in enumerate(ids):
        c = by_id[str(handles.by_id[rid])]
        assert c.num_computed_tokens == 100 + i
        assert c.new_block_ids == ([1000 + i] if i % 16 == 0 else [])
        assert back.num_scheduled_tokens[c.request_id] == 1
    (resumed,) = [c for c in back.cached_requests if c.resumed]
    assert resumed.new_block_ids == [7, 8] and resumed.new_token_ids == [5, 6]
    # columns that disagree are refused on the worker
    del step.running.num_new_blocks[-1]
    with pytest.raises(ValueError, match="running columns of unequal length"):
        decode_step(step)


def test_one_token_answers_travel_in_columns():
    handles = HandleTable()
    ha, hb, hc = (str(handles.assign(r)) for r in "abc")
    result = encode_step_result(4, {ha: [5], hb: [], hc: [6]})
    assert list(result.sampled_handles) == [int(ha), int(hc)]
    assert list(result.sampled_token_ids) == [5, 6]
    assert [item.handle for item in result.sampled] == [int(hb)]  # a partial prefill: an item
    assert decode_step_result(result, handles, 100)[0] == {"a": [5], "b": [], "c": [6]}


def test_a_step_carries_the_leaders_epoch_and_a_new_requests_real_id():
    handles = HandleTable()
    p = SamplingParams(max_tokens=4)
    out = SchedulerOutput(
        new_requests=[NewRequestData("req-a", [1, 2], p, [0], 0)],
        num_scheduled_tokens={"req-a": 2},
        total_num_scheduled_tokens=2,
        step_id=1,
    )
    step = encode_step(out, handles, epoch=12)
    assert step.epoch == 12 and step.new_requests[0].request_id == "req-a"
    assert decode_step(step).new_requests[0].request_id == str(handles.by_id["req-a"])
    assert encode_step(SchedulerOutput(step_id=2), handles).epoch == 0  # embedded: no etcd


def test_a_request_id_placed_again_while_its_finish_is_in_flight_gets_a_handle_of_its_own():
    """Pipelined steps: "a" finishes in step 2, is placed again (same id, a resubmission) in
    step 3 before step 2's result is in. The new "a" must not share the retiring handle: the
    release after step 2's result would take it from under it (or hand it to another request)."""
    from common.convert import HandleTable, encode_step
    from common.messages import NewRequestData, SamplingParams, SchedulerOutput

    def new(rid: str) -> NewRequestData:
        return NewRequestData(rid, [1, 2, 3], SamplingParams(), [0], 0)

    handles = HandleTable()
    step1 = encode_step(
        SchedulerOutput(new_requests=[new("a")], num_scheduled_tokens={"a": 3}, step_id=1),
        handles,
        release=False,
    )
    old = step1.new_requests[0].handle
    step2 = encode_step(SchedulerOutput(finished_req_ids={"a"}, step_id=2), handles, release=False)
    assert list(step2.finished) == [old]
    step3 = encode_step(
        SchedulerOutput(new_requests=[new("a")], num_scheduled_tokens={"a": 3}, step_id=3),
        handles,
        release=False,
    )
    fresh = step3.new_requests[0].handle
    assert fresh != old
    handles.release_handles(step2.finished)  # step 2's result is in
    assert handles.by_id["a"] == fresh and handles.by_handle[fresh] == "a"
    assert old not in handles.by_handle and handles.assign("b") == old
