"""The Model Server Protocol's metrics (vLLM's names, read by the Gateway API Inference
Extension's endpoint picker and by KEDA/HPA queries) on the leader's and the front-ends' /metrics:
real Prometheus text, gauges, the same numbers as the splitserve: families."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.pb import generation_pb2 as gen_pb
from frontend_svc.observer import FrontendObserver
from scheduler_svc.obs.worker_collector import WorkerCollector

MSP = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
}


def families(text: str) -> dict:
    # the TYPE lines first: what a scraper reads the kind from
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    return {name: (types.get(name), parsed[name].samples) for name in parsed}


def check_model_server_families(text: str, model: str, running, waiting, kv_usage) -> None:
    found = families(text)
    assert MSP <= set(found), MSP - set(found)
    for name in MSP:
        kind, samples = found[name]
        assert kind == "gauge", name
        assert len(samples) == 1 and samples[0].name == name
    value = {name: found[name][1][0].value for name in MSP}
    labels = {name: found[name][1][0].labels for name in MSP}
    assert value["vllm:num_requests_running"] == running
    assert value["vllm:num_requests_waiting"] == waiting
    assert abs(value["vllm:kv_cache_usage_perc"] - kv_usage) < 1e-9
    for name in MSP - {"vllm:lora_requests_info"}:
        assert labels[name] == {"model_name": model}
    # no LoRA: nothing running or waiting, none loadable; the value is the time of the update
    assert labels["vllm:lora_requests_info"] == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert abs(value["vllm:lora_requests_info"] - time.time()) < 60


def test_scheduler_serves_the_model_server_metrics_from_its_workers_numbers():
    def stats(running, waiting, used, total):
        return SimpleNamespace(
            num_running=running,
            num_waiting=waiting,
            kv_usage=used / total,
            num_used_blocks=used,
            num_total_blocks=total,
        )

    sessions = [
        (SimpleNamespace(lost=False, worker_id="w0"), stats(3, 1, 30, 100)),
        (SimpleNamespace(lost=False, worker_id="w1"), stats(2, 4, 10, 300)),
        (SimpleNamespace(lost=True, worker_id="w2"), stats(9, 9, 99, 100)),  # gone: not counted
    ]
    engine = SimpleNamespace(
        worker_stats=lambda: sessions, num_waiting=5, requests={}, model_name="smol"
    )
    registry = CollectorRegistry()
    registry.register(WorkerCollector(engine))
    text = generate_latest(registry).decode()
    # waiting: the global queue and the workers' queues; KV: used over total blocks of all
    check_model_server_families(text, "smol", running=5, waiting=10, kv_usage=40 / 400)
    # the splitserve: names are still there, per worker
    assert "splitserve:num_requests_waiting" in families(text)


def test_frontend_serves_them_from_the_leaders_status_and_nothing_without_a_leader():
    info = gen_pb.ServerInfo(
        num_waiting=2,
        workers=[
            gen_pb.WorkerInfo(
                worker_id="a",
                num_blocks=100,
                num_free_blocks=50,
                num_running=4,
                num_waiting=1,
                state="active",
            ),
            gen_pb.WorkerInfo(
                worker_id="b",
                num_blocks=100,
                num_free_blocks=100,
                num_running=0,
                num_waiting=0,
                state="draining",
            ),
        ],
    )
    leader = {"info": info}
    observer = FrontendObserver()
    observer.watch_leader("smol", lambda: leader["info"])
    text = generate_latest(observer.registry).decode()
    check_model_server_families(text, "smol", running=4, waiting=3, kv_usage=0.25)
    assert "splitserve:frontend_requests_accepted_total" in text  # its own metrics stay
    leader["info"] = None
    assert not MSP & set(families(generate_latest(observer.registry).decode()))
