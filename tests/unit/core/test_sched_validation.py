"""Admission validation and config checks: every rejection is a sentence naming the problem."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core import (
    Request,
    RequestRejected,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    validate_sampling_params,
)
from tests.factories import scheduler_factory

make = scheduler_factory(
    max_num_batched_tokens=512, max_num_seqs=8, block_size=16, num_blocks=64, max_model_len=2048
)


def reject(s: Scheduler, request: Request) -> str:
    before = s.get_num_unfinished_requests()
    with pytest.raises(RequestRejected) as info:
        s.add_request(request)
    assert s.get_num_unfinished_requests() == before  # nothing queued
    return str(info.value)


def test_rejected_is_a_value_error():
    assert issubclass(RequestRejected, ValueError)
    assert issubclass(SchedulerConfigError, ValueError)


def test_empty_prompt():
    assert "prompt is empty" in reject(make(), Request("a", []))


def test_prompt_at_or_over_max_model_len():
    s = make(max_model_len=2048, num_blocks=1000)
    msg = reject(s, Request("a", [1] * 3000))
    assert msg == "prompt has 3000 tokens but max_model_len is 2048; shorten the prompt"
    assert "prompt has 2048 tokens" in reject(s, Request("b", [1] * 2048))
    s.add_request(Request("c", [1] * 2047))


def test_prompt_longer_than_budget_with_chunked_prefill_off():
    s = make(max_num_batched_tokens=100, enable_chunked_prefill=False)
    msg = reject(s, Request("a", [1] * 101))
    assert "101 tokens" in msg and "max_num_batched_tokens" in msg and "chunked prefill" in msg
    s.add_request(Request("b", [1] * 100))
    make(max_num_batched_tokens=100).add_request(Request("c", [1] * 101))  # chunked: fine


def test_prompt_needing_more_blocks_than_the_pool():
    s = make(block_size=16, num_blocks=4)
    msg = reject(s, Request("a", [1] * 65))
    assert "5 KV blocks" in msg and "has only 4" in msg
    s.add_request(Request("b", [1] * 64))


@pytest.mark.parametrize(
    "params, words",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens (5) must not exceed max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_p=math.nan), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(min_p=1.1), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=math.nan), "repetition_penalty"),
        (SamplingParams(presence_penalty=math.nan), "presence_penalty"),
        (SamplingParams(frequency_penalty=math.inf), "frequency_penalty"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(stop_token_ids=[3, -4]), "negative token id"),
        (SamplingParams(temperature="hot"), "temperature"),  # type: ignore[arg-type]
    ],
)
def test_bad_sampling_values(params, words):
    with pytest.raises(RequestRejected) as info:
        validate_sampling_params(params)
    assert words in str(info.value)
    assert words in reject(make(), Request("a", [1, 2], params))


def test_good_sampling_values_pass():
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=0),
        SamplingParams(
            temperature=2.0,
            top_p=0.01,
            top_k=50,
            min_p=1.0,
            repetition_penalty=1.3,
            max_tokens=5,
            min_tokens=5,
            stop_token_ids=[0, 7],
            seed=3,
        ),
    ):
        validate_sampling_params(params)


def test_negative_prompt_token_ids():
    assert "negative token id (-5)" in reject(make(), Request("a", [1, -5, 2]))


def test_non_integer_prompt_token_ids():
    assert "integers" in reject(make(), Request("a", [1, 2.5, 2]))  # type: ignore[list-item]


def test_duplicate_request_id_in_flight():
    s = make()
    s.add_request(Request("a", [1, 2]))
    assert "already in flight" in reject(s, Request("a", [3]))
    out = s.schedule()  # now running
    assert "already in flight" in reject(s, Request("a", [3]))
    assert out.num_scheduled_tokens == {"a": 2}


def test_migrated_request_with_nothing_left_to_generate():
    s = make(max_model_len=16)
    r = Request("a", [1] * 10, SamplingParams(max_tokens=3), output_token_ids=[5, 6, 7])
    assert "nothing is left to generate" in reject(s, r)
    r = Request("b", [1] * 10, SamplingParams(max_tokens=30), output_token_ids=[5] * 6)
    assert "max_model_len 16" in reject(s, r)


def test_rejection_leaves_no_trace():
    s = make(block_size=16, num_blocks=4)
    reject(s, Request("a", [1] * 100))
    assert s.stats().num_waiting == 0
    s.add_request(Request("a", [1] * 10))  # the id is free


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_host_blocks=-1), "num_host_blocks"),
        (dict(watermark=1.0), "watermark"),
        (dict(watermark=-0.1), "watermark"),
        (dict(watermark=math.nan), "watermark"),
        (dict(policy="lottery"), "unknown scheduling policy 'lottery'; choose one of fcfs"),
        (dict(preemption_mode="teleport"), "unknown preemption_mode 'teleport'"),
        (dict(auto_swap_min_tokens=-1), "auto_swap_min_tokens"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    ],
)
def test_config_errors(kw, words):
    with pytest.raises(SchedulerConfigError) as info:
        SchedulerConfig(**kw)
    assert words in str(info.value)


def test_config_defaults_and_preemption_modes_accepted():
    for mode in ("recompute", "swap", "auto"):
        assert SchedulerConfig(preemption_mode=mode).preemption_mode == mode
    cfg = SchedulerConfig(preemption_mode="recompute", policy="priority")
    assert cfg.block_size == 16 and cfg.num_host_blocks == 0 and cfg.watermark == 0.01
    assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching
    assert cfg.long_prefill_token_threshold == 0
