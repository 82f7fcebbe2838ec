"""The real system: a scheduler process and a worker process with SmolLM2 on loopback gRPC."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from common.client import SplitserveClient
from common.model_source import resolve_model
from common.tokenizer import load_tokenizer
from tests.e2e.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_TOKENS = 12


def wait_idle(client: SplitserveClient, timeout: float = 30.0):
    """Until nothing is in flight; returns the last server info."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        busy = info.num_requests_in_flight or any(
            w.num_running or w.num_waiting for w in info.workers
        )
        if not busy:
            return info
        assert time.monotonic() < deadline, f"still busy: {info}"
        time.sleep(0.05)


def assert_no_block_leak(client: SplitserveClient) -> None:
    info = wait_idle(client)
    for w in info.workers:
        assert w.num_free_blocks == w.num_blocks, f"blocks leaked on {w.worker_id}: {w}"


@pytest.fixture(scope="module")
def hf_greedy():
    """Hugging Face generate on the same (converted) weights, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(None)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(None).converted_dir, dtype=torch.float32
    )
    model.eval()
    results = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            results[prompt] = out[0, len(ids) :].tolist()
    return results


def test_greedy_over_grpc_equals_hugging_face(client, hf_greedy):
    for prompt in PROMPTS:
        result = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy[prompt], prompt
        assert result.text == load_tokenizer(None).decode(result.token_ids)


def test_greedy_over_grpc_equals_in_process(client, hf_greedy):
    from splitserve.inprocess import generate_in_process

    tok = load_tokenizer(None)
    in_process = generate_in_process(
        [tok.encode(p) for p in PROMPTS], max_tokens=MAX_TOKENS, num_blocks=64
    )
    over_grpc = [
        client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).token_ids
        for p in PROMPTS
    ]
    assert over_grpc == in_process


def test_32_concurrent_streams_all_finish(client):
    results: dict[int, list] = {}
    errors = []

    def one(i: int) -> None:
        try:
            chunks = list(
                client.stream(
                    f"Request number {i}: tell me a fact about",
                    max_tokens=8 + i % 5,
                    temperature=0.8,
                    seed=i,
                    ignore_eos=True,
                )
            )
            results[i] = chunks
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    assert len(results) == 32
    for i, chunks in results.items():
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == 8 + i % 5
        assert chunks[-1].finish_reason and chunks[-1].completion_tokens == len(tokens)
        assert all(not c.finish_reason for c in chunks[:-1])
    assert_no_block_leak(client)


def test_cancelling_a_stream_frees_its_blocks(client):
    stream = client.stream(
        "Write a very long story about a dragon.",
        max_tokens=400,
        temperature=0.0,
        ignore_eos=True,
        request_id="to-cancel",
    )
    got = 0
    for msg in stream:
        got += len(msg.token_ids)
        if got >= 5:
            break
    info = client.server_info()
    assert any(w.num_free_blocks < w.num_blocks for w in info.workers) or got >= 400
    stream.close()  # cancels the RPC
    assert_no_block_leak(client)
    with pytest.raises(grpc.RpcError) as err:
        client.abort("to-cancel")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def abort_mid_stream(client, request_id: str, samples: int = 1) -> list:
    """Streams a long greedy request (`samples` of it) on a thread, aborts it once every sample
    has sent tokens, and returns every message the stream gave."""
    received = []

    def consume():
        received.extend(
            client.stream(
                "Count slowly:",
                n=samples,
                max_tokens=500,
                temperature=0.0,
                ignore_eos=True,
                request_id=request_id,
            )
        )

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 30
    while len({m.index for m in received if m.token_ids}) < samples and time.monotonic() < deadline:
        time.sleep(0.02)
    client.abort(request_id)
    t.join(30)
    return received


def test_abort_ends_the_stream_with_abort(client):
    received = abort_mid_stream(client, "abort-me")
    assert received[-1].finish_reason == 3  # FINISH_REASON_ABORT
    assert_no_block_leak(client)


BAD_INPUTS = [
    (dict(prompt=""), "empty"),
    (dict(prompt="x " * 1100), "max_model_len"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", model="gpt-17"), "unknown model"),
    (dict(token_ids=[1, 2, 10**9]), "vocabulary"),
    (dict(prompt="hi", structured={"kind": "regex", "spec": "(("}), "regex is not valid"),
    (dict(prompt="hi", structured={"kind": "yaml"}), "unknown structured output kind"),
    (dict(prompt="hi", n=17), "n must be in [1, 16]"),
]


def test_n_samples_share_one_prompt_over_grpc(client, hf_greedy):
    prompt = PROMPTS[2]
    greedy = client.generate_choices(
        prompt, n=4, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    assert [r.token_ids for r in greedy] == [hf_greedy[prompt]] * 4
    assert all(r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS for r in greedy)
    assert len({r.request_id for r in greedy}) == 1  # one call, the samples told by index
    kwargs = dict(n=3, max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)
    sampled = [r.token_ids for r in client.generate_choices(prompt, **kwargs)]
    assert len({tuple(t) for t in sampled}) > 1  # a seed stream per sample (seed + index)
    assert sampled == [r.token_ids for r in client.generate_choices(prompt, **kwargs)]
    assert_no_block_leak(client)


def test_abort_ends_every_sample_of_a_group(client):
    received = abort_mid_stream(client, "abort-group", samples=3)
    ended = {m.index: m.finish_reason for m in received if m.finish_reason}
    assert ended == {0: 3, 1: 3, 2: 3}  # FINISH_REASON_ABORT, each sample
    assert_no_block_leak(client)


def test_structured_output_over_grpc(client):
    result = client.generate(
        "A phone number:",
        max_tokens=16,
        temperature=1.0,
        seed=11,
        structured={"kind": "regex", "spec": r" \(\d{3}\) \d{3}-\d{4}"},
    )
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", result.text), result.text
    assert result.finish_reason == "stop"
    assert_no_block_leak(client)


@pytest.mark.parametrize(
    "kwargs,needle", BAD_INPUTS, ids=[b[1] + str(i) for i, b in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_invalid_argument(client, kwargs, needle):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle.lower() in err.value.details().lower()
    # still serving, nothing leaked
    assert client.generate("2 + 2 =", max_tokens=2, temperature=0.0).completion_tokens >= 1
    assert_no_block_leak(client)


def test_duplicate_request_id_in_flight(client):
    first = client.stream(
        "Tell me a long story.", max_tokens=200, temperature=0.0, ignore_eos=True, request_id="dup"
    )
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("again", request_id="dup", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in err.value.details()
    first.close()
    assert_no_block_leak(client)


def test_abort_unknown_id_is_not_found(client):
    with pytest.raises(grpc.RpcError) as err:
        client.abort("never-existed")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_cli_generate_json(cluster):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "generate",
            "The capital of France is",
            "--scheduler",
            cluster.target,
            "--max-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert set(obj) >= {"text", "token_ids", "finish_reason"}
    assert len(obj["token_ids"]) <= 5 and obj["finish_reason"] in ("length", "stop")


def test_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(cluster.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Generation"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "splitserve.v1.Generation" in names
