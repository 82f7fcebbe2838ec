"""Fuzzing the paths untrusted bytes take: protobuf parsing, proto -> core conversion and
request validation either accept or refuse with RequestRejected; nothing else escapes."""

from __future__ import annotations

import math

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.convert import (
    HandleTable,
    decode_step,
    decode_step_result,
    encode_step,
    encode_step_result,
)
from common.pb import generation_pb2 as gen_pb
from common.pb import worker_link_pb2 as wl_pb
from common.tokenizer import load_tokenizer
from frontend_svc.intake import Intake
from scheduler_svc.core import (
    CachedRequestData,
    NewRequestData,
    RequestRejected,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    validate_request,
)

SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def intake():
    tok = load_tokenizer(None)
    return Intake(tok, tok.name, {tok.name}, max_model_len=256)


CORE_CFG = SchedulerConfig(
    max_num_batched_tokens=128, max_num_seqs=8, block_size=16, num_blocks=32, max_model_len=256
)


def build_or_reject(intake: Intake, request: gen_pb.GenerateRequest) -> None:
    try:
        state = intake.build(request)
    except RequestRejected as exc:
        assert str(exc)  # a sentence, never empty
        return
    assert 0 < len(state.prompt_token_ids) < intake.max_model_len
    assert all(0 <= t < intake.vocab_size for t in state.prompt_token_ids)
    p = state.params
    assert p.max_tokens >= 1 and p.temperature >= 0 and 0 < p.top_p <= 1
    assert math.isfinite(p.temperature) and math.isfinite(p.repetition_penalty)
    try:
        validate_request(state.to_core_request(), CORE_CFG)
    except RequestRejected as exc:
        assert str(exc)


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_random_bytes_parse_or_decode_error_then_validate(intake, raw):
    try:
        request = gen_pb.GenerateRequest.FromString(raw)
    except DecodeError:
        return
    build_or_reject(intake, request)


floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
int32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def generate_requests(draw):
    request = gen_pb.GenerateRequest(
        request_id=draw(st.text(max_size=20)),
        priority=draw(int32),
        tenant=draw(st.text(max_size=10)),
        deadline_s=draw(floats),
        model=draw(st.sampled_from(["", "SmolLM2-135M-Instruct", "other", "\x00"])),
    )
    kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=300))
    elif kind == "ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300)))
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            request.chat.messages.add(
                role=draw(st.sampled_from(["user", "system", "x", ""])),
                content=draw(st.text(max_size=50)),
            )
    s = request.sampling
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    for name in ("max_tokens", "min_tokens", "top_k", "logprobs"):
        if draw(st.booleans()):
            setattr(s, name, draw(int32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(-(2**63), 2**63 - 1))
    s.stop_token_ids.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)))
    s.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    s.ignore_eos = draw(st.booleans())
    return request


@SETTINGS
@given(request=generate_requests())
def test_structured_requests_are_built_or_rejected(intake, request):
    build_or_reject(intake, request)
    # and the same request survives the wire byte for byte
    assert gen_pb.GenerateRequest.FromString(request.SerializeToString()) == request


@st.composite
def scheduler_outputs(draw):
    out = SchedulerOutput(step_id=draw(st.integers(0, 2**40)))
    ids = draw(st.lists(st.text(min_size=1, max_size=6), unique=True, max_size=6))
    for rid in ids:
        n = draw(st.integers(0, 50))
        if draw(st.booleans()):
            out.new_requests.append(
                NewRequestData(
                    rid,
                    draw(st.lists(st.integers(0, 2**31), min_size=1, max_size=20)),
                    SamplingParams(
                        max_tokens=draw(st.integers(1, 100)),
                        temperature=draw(st.floats(0, 2)),
                        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
                    ),
                    draw(st.lists(st.integers(0, 2**31), max_size=5)),
                    draw(st.integers(0, 100)),
                    draw(st.lists(st.integers(0, 2**31), max_size=5)),
                )
            )
        else:
            out.cached_requests.append(
                CachedRequestData(
                    rid,
                    draw(st.lists(st.integers(0, 2**31), max_size=3)),
                    draw(st.integers(0, 2**31)),
                    draw(st.booleans()),
                )
            )
        if n:
            out.num_scheduled_tokens[rid] = n
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


@SETTINGS
@given(out=scheduler_outputs())
def test_step_encoding_round_trips(out):
    handles = HandleTable()
    for c in out.cached_requests:  # the worker saw these before
        handles.assign(c.request_id)
    back = decode_step(wl_pb.Step.FromString(encode_step(out, handles).SerializeToString()))
    to_handle = {str(handles.by_id[r]): r for r in handles.by_id}
    assert {
        to_handle[k]: v for k, v in back.num_scheduled_tokens.items()
    } == out.num_scheduled_tokens
    assert [to_handle[n.request_id] for n in back.new_requests] == [
        n.request_id for n in out.new_requests
    ]
    for mine, theirs in zip(out.new_requests, back.new_requests, strict=True):
        assert theirs.prompt_token_ids == mine.prompt_token_ids
        assert theirs.block_ids == mine.block_ids
        assert theirs.sampling_params.seed == mine.sampling_params.seed
    # running requests travel in columns, resumed ones singly: the order may change
    by_id = {to_handle[c.request_id]: c for c in back.cached_requests}
    assert len(by_id) == len(back.cached_requests) == len(out.cached_requests)
    for mine in out.cached_requests:
        theirs = by_id[mine.request_id]
        assert theirs.new_block_ids == mine.new_block_ids
        assert theirs.num_computed_tokens == mine.num_computed_tokens
        assert theirs.resumed == mine.resumed


@SETTINGS
@given(raw=st.binary(max_size=120))
def test_random_step_results_decode_or_raise_value_error(raw):
    handles = HandleTable()
    handles.assign("a")
    try:
        result = wl_pb.StepResult.FromString(raw)
    except DecodeError:
        return
    try:
        sampled, _ = decode_step_result(result, handles)
    except ValueError:
        return
    assert set(sampled) <= {"a"}


def test_step_result_round_trip():
    handles = HandleTable()
    handle = handles.assign("req")
    result = encode_step_result(3, {str(handle): [42]})
    sampled, _ = decode_step_result(
        wl_pb.StepResult.FromString(result.SerializeToString()), handles
    )
    assert sampled == {"req": [42]}
