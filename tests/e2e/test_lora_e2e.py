"""Multi-LoRA through real processes: a scheduler with its HTTP port and API key, two SmolLM2
workers with adapter slots, PEFT adapters made here (random, non-zero B) and Hugging Face +
PEFT as the oracle.

What it shows: adapters given at start and loaded at run time are listed in /v1/models with
their parent; a request naming one runs it (greedy tokens equal HF + PEFT's, four kinds mixed
and concurrent); bad adapters are refused with a sentence and nothing stays loaded; unloading
lets the requests in flight finish; vllm:lora_requests_info and the per-adapter counters; a
worker killed -9 under adapter requests: they finish on the other worker with the reference
tokens.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest

from common.client import SplitserveClient
from tests.e2e.conftest import SCHEDULER_FLAGS, WORKER_FLAGS
from tests.e2e.http_cluster import API_KEY, AUTH, HttpCluster
from tests.e2e.procs import Cluster, free_port
from tests.unit.worker.lora_adapters import ADAPTERS, make_adapter, peft_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def base_dir(smollm2_path):
    from common.model_source import resolve_model
    from worker_svc.model_loader import model_dir

    return model_dir(resolve_model(str(smollm2_path)))


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(base_dir, root / name, seed=10 + i, **options)
        for i, (name, options) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def prompt_ids(base_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(base_dir, adapters, prompt_ids):
    """HF + PEFT's greedy tokens per (adapter or "" for the base, prompt index)."""
    by_adapter = peft_greedy(base_dir, adapters, prompt_ids, MAX_TOKENS)
    return {
        (name, i): tokens
        for name, outputs in by_adapter.items()
        for i, tokens in enumerate(outputs)
    }


@pytest.fixture(scope="module")
def long_reference(base_dir, adapters, prompt_ids):
    """As `reference`, 4 x MAX_TOKENS tokens, for r4 and r8-rslora."""
    picked = {name: adapters[name] for name in ("r4", "r8-rslora")}
    by_adapter = peft_greedy(base_dir, picked, prompt_ids, 4 * MAX_TOKENS)
    return {(n, i): t for n, outputs in by_adapter.items() for i, t in enumerate(outputs)}


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory, adapters):
    c = Cluster(tmp_path_factory.mktemp("lora-cluster"))
    http_port = free_port()
    lora_flags = ("--max-loras", "2", "--max-lora-rank", "16", "--num-threads", "1")
    try:
        c.start_scheduler(*SCHEDULER_FLAGS, "--http-port", str(http_port), "--api-key", API_KEY)
        procs = {
            "w0": c.start_worker(
                "w0", *WORKER_FLAGS, *lora_flags, "--lora-modules", f"r4={adapters['r4']}"
            ),
            "w1": c.start_worker("w1", *WORKER_FLAGS, *lora_flags),
        }
        hc = HttpCluster(c, http_port)
        with hc.grpc_client() as client:
            client.wait_for_workers(2, timeout=300)
        hc.procs = procs
        yield hc
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


def models(hc: HttpCluster) -> dict[str, dict]:
    body = httpx.get(hc.url("/v1/models"), headers=AUTH, timeout=30).json()
    return {m["id"]: m for m in body["data"]}


def load(hc: HttpCluster, name: str, path) -> httpx.Response:
    return httpx.post(
        hc.url("/v1/load_lora_adapter"),
        headers=AUTH,
        json={"lora_name": name, "lora_path": str(path)},
        timeout=180,
    )


def unload(hc: HttpCluster, name: str) -> httpx.Response:
    return httpx.post(
        hc.url("/v1/unload_lora_adapter"), headers=AUTH, json={"lora_name": name}, timeout=60
    )


def stream_tokens(
    hc: HttpCluster, model: str, prompt_ids: list[int], workers=None, long: bool = False
) -> list[int]:
    """Greedy tokens; `long`: 4 x MAX_TOKENS of them (the first MAX_TOKENS are the reference's)."""
    tokens = []
    with hc.grpc_client() as client:
        for msg in client.stream(
            token_ids=prompt_ids,
            model=model,
            max_tokens=MAX_TOKENS * (4 if long else 1),
            temperature=0.0,
            ignore_eos=True,
        ):
            tokens.extend(msg.token_ids)
            if workers is not None and msg.worker_id:
                workers.add(msg.worker_id)
    return tokens


def run_concurrently(hc, jobs: list[tuple[str, int]], prompt_ids) -> dict:
    results: dict = {}

    def one(key):
        name, i = key
        results[key] = stream_tokens(hc, name, prompt_ids[i])

    threads = [threading.Thread(target=one, args=(key,)) for key in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def test_adapters_at_start_are_listed_with_their_parent(lora_cluster):
    listed = models(lora_cluster)
    base = next(m for m in listed.values() if "parent" not in m)
    assert listed["r4"]["parent"] == base["id"]
    assert listed["r4"]["root"].endswith("r4")
    assert httpx.get(lora_cluster.url("/v1/models/r4"), headers=AUTH).json()["parent"]


def test_unknown_model_is_404_model_not_found(lora_cluster, prompt_ids):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        lora_cluster.openai().completions.create(model="no-such-adapter", prompt="hi")
    assert err.value.body["code"] == "model_not_found"
    assert "no-such-adapter" in err.value.body["message"]


def test_bad_adapters_are_refused_and_nothing_stays_loaded(
    lora_cluster, base_dir, tmp_path, tiny_llama_dir
):
    other_base = make_adapter(tiny_llama_dir, tmp_path / "other", seed=3, r=4, lora_alpha=8)
    too_wide = make_adapter(
        base_dir, tmp_path / "wide", seed=4, r=32, lora_alpha=8, target_modules=["q_proj"]
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((too_wide / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    for name, path in (
        ("other-base", other_base),
        ("too-wide", too_wide),
        ("missing", tmp_path / "nowhere"),
        ("corrupt", corrupt),
    ):
        answer = load(lora_cluster, name, path)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert message.endswith(".") or len(message) > 20, message  # a sentence, not a code
        assert name not in models(lora_cluster)
    wide = load(lora_cluster, "too-wide", too_wide).json()["error"]["message"]
    assert "32" in wide and "16" in wide, wide  # names the rank and the limit
    taken = load(lora_cluster, "r4", "/elsewhere")
    assert taken.status_code == 400 and "already loaded" in taken.text
    assert unload(lora_cluster, "never-loaded").status_code == 404
    no_key = httpx.post(
        lora_cluster.url("/v1/load_lora_adapter"), json={"lora_name": "x", "lora_path": "/tmp"}
    )
    assert no_key.status_code == 401


def test_four_kinds_mixed_equal_hf_peft(
    lora_cluster, base_dir, adapters, prompt_ids, reference, long_reference
):
    # loaded while requests run: they go on untouched
    busy: dict = {}
    runs = [
        threading.Thread(
            target=lambda i=i: busy.update(
                {i: stream_tokens(lora_cluster, "r4", prompt_ids[i % 2], long=True)}
            )
        )
        for i in range(4)
    ]
    for t in runs:
        t.start()
    for name in ("r8-rslora", "r16-some"):
        answer = load(lora_cluster, name, adapters[name])
        assert answer.status_code == 200, answer.text
    for t in runs:
        t.join(300)
    assert all(busy[i] == long_reference[("r4", i % 2)] for i in range(4)), busy
    listed = models(lora_cluster)
    assert {"r4", "r8-rslora", "r16-some"} <= listed.keys()
    # three adapters and the base, two prompts each, all at once on 2 workers of 2 slots
    jobs = [(name, i) for name in ("", *adapters) for i in range(len(PROMPTS))]
    results = run_concurrently(lora_cluster, jobs, prompt_ids)
    for key in jobs:
        assert results[key] == reference[key], key
    # the adapters change the output: the test would notice them being ignored
    assert reference[("r4", 0)] != reference[("", 0)]
    # gRPC's lora_name field names an adapter as `model` does; a wrong one is refused
    with lora_cluster.grpc_client() as client:
        named = client.generate(
            token_ids=prompt_ids[1],
            lora_name="r8-rslora",
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
        )
        assert list(named.token_ids) == reference[("r8-rslora", 1)]
        with pytest.raises(grpc.RpcError) as err:
            client.generate(token_ids=prompt_ids[1], lora_name="nope", max_tokens=1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the OpenAI client names an adapter as its model
    text = (
        lora_cluster.openai()
        .completions.create(
            model="r4", prompt=prompt_ids[0], max_tokens=MAX_TOKENS, temperature=0.0
        )
        .choices[0]
        .text
    )
    from transformers import AutoTokenizer

    assert text == AutoTokenizer.from_pretrained(base_dir).decode(reference[("r4", 0)])


def test_metrics_say_which_adapters_ran(lora_cluster):
    body = httpx.get(lora_cluster.url("/metrics"), timeout=30).text
    info = next(line for line in body.splitlines() if line.startswith("vllm:lora_requests_info"))
    assert 'max_lora="2"' in info
    finished = [
        line
        for line in body.splitlines()
        if line.startswith('splitserve:lora_requests_finished_total{lora_name="r4"}')
    ]
    assert finished and float(finished[0].split()[-1]) >= 2
    state = httpx.get(lora_cluster.url("/dashboard/api/state"), timeout=30).json()
    cards = {w["worker_id"]: w for w in state["workers"]}
    assert {cards[w]["max_loras"] for w in ("w0", "w1")} == {2}
    assert any(cards[w]["resident_loras"] for w in ("w0", "w1"))  # adapters in slots, shown


def test_unload_lets_the_requests_in_flight_finish(lora_cluster, adapters, prompt_ids, reference):
    results: dict = {}
    started = threading.Event()

    def one(i):
        tokens = []
        with lora_cluster.grpc_client() as client:
            for msg in client.stream(
                token_ids=prompt_ids[i % 2],
                model="r16-some",
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            ):
                tokens.extend(msg.token_ids)
                started.set()
        results[i] = tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(120)
    answer = unload(lora_cluster, "r16-some")
    assert answer.status_code == 200, answer.text
    for t in threads:
        t.join(300)
    for i in range(4):
        assert results[i] == reference[("r16-some", i % 2)], i
    assert "r16-some" not in models(lora_cluster)
    import openai

    with pytest.raises(openai.NotFoundError):
        lora_cluster.openai().completions.create(model="r16-some", prompt="hi", max_tokens=1)
    # the workers drop it once nothing runs with it; then it may be loaded again
    deadline = time.monotonic() + 30
    while (again := load(lora_cluster, "r16-some", adapters["r16-some"])).status_code != 200:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.5)


def test_worker_killed_under_adapter_requests(lora_cluster, adapters, prompt_ids, long_reference):
    """kill -9 the worker running most adapter requests: they finish on the other one, exact."""
    if "r8-rslora" not in models(lora_cluster):  # run alone: load what it uses
        assert load(lora_cluster, "r8-rslora", adapters["r8-rslora"]).status_code == 200
    results: dict = {}
    workers: dict = {i: set() for i in range(6)}  # filled as the streams say
    progress = dict.fromkeys(range(6), 0)

    def one(i):
        tokens = []
        with lora_cluster.grpc_client() as client:
            for msg in client.stream(
                token_ids=prompt_ids[i % 2],
                model=("r4", "r8-rslora")[i % 2],
                max_tokens=4 * MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            ):
                tokens.extend(msg.token_ids)
                progress[i] = len(tokens)
                if msg.worker_id:
                    workers[i].add(msg.worker_id)
        results[i] = tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while sum(progress.values()) < 12:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    busiest = max(("w0", "w1"), key=lambda w: sum(w in seen for seen in workers.values()))
    lora_cluster.procs[busiest].signal(signal.SIGKILL)
    for t in threads:
        t.join(300)
    moved = [i for i in range(6) if workers[i] == {"w0", "w1"}]
    assert moved, workers  # some ran on the killed worker and finished on the other
    for i in range(6):
        name = ("r4", "r8-rslora")[i % 2]
        assert results[i] == long_reference[(name, i % 2)], (i, workers[i])


def test_adapters_through_a_step_shard(tmp_path, adapters, prompt_ids, reference):
    """A shard's worker read r4 at start: the shard reports it, the leader learns it, places
    r4 requests there and the front-end serves it; tokens equal HF + PEFT's."""
    from tests.e2e.test_step_shards import ShardedCluster

    sharded = ShardedCluster(Cluster(tmp_path))
    worker_args = (
        *WORKER_FLAGS,
        "--num-threads",
        "1",
        "--max-loras",
        "2",
        "--lora-modules",
        f"r4={adapters['r4']}",
    )
    try:
        sharded.start(1, worker_args=worker_args)
        with SplitserveClient(sharded.target, timeout=120) as client:
            deadline = time.monotonic() + 300
            while not [a.name for a in client.server_info().loras]:
                assert time.monotonic() < deadline, sharded.base.logs()
                time.sleep(0.5)
            assert [a.name for a in client.server_info().loras] == ["r4"]
            for i in range(len(PROMPTS)):
                tokens = client.generate(
                    token_ids=prompt_ids[i],
                    model="r4",
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                ).token_ids
                assert list(tokens) == reference[("r4", i)], i
    except BaseException:
        print(sharded.base.logs())
        raise
    finally:
        sharded.base.stop_all()
