"""Configuration field groups: declared once in common/config_groups.py, shared by every
service config that has them, flat on the config, and the headings of each `--help`."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.config_groups import ClientAccess, HttpLimits, ServedModel
from common.settings import add_dataclass_args, dataclass_from_args, to_argv
from frontend_svc.config import FrontendConfig
from scheduler_svc.config import SchedulerServiceConfig
from splitserve import cli
from worker_svc.config import ModelRunnerConfig
from worker_svc.link import WorkerLinkConfig

CONFIGS = (SchedulerServiceConfig, FrontendConfig, WorkerLinkConfig, ModelRunnerConfig)
# the same name, another meaning: the worker link's messages, the worker's model length (None =
# the model's own), each reconciled or apart by design
WORKER_OWN = {"max_message_bytes", "max_model_len"}


def fields_of(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def help_of(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping (argparse breaks lines at hyphens too)
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_a_field_the_scheduler_and_front_end_share_is_declared_once():
    sched, front = fields_of(SchedulerServiceConfig), fields_of(FrontendConfig)
    shared = sched.keys() & front.keys()
    assert len(shared) >= 19  # endpoint, TLS, model, limits, logging, cluster
    for name in shared:
        assert sched[name] is front[name], name  # one declaration, not two equal ones
    worker = fields_of(WorkerLinkConfig) | fields_of(ModelRunnerConfig)
    for name in (worker.keys() & front.keys()) - WORKER_OWN:
        assert worker[name] is front[name], name


def test_configs_stay_flat_and_slotted():
    cfg = FrontendConfig(tls_cert_file="c.pem", max_model_len=77, max_request_bytes=5)
    assert (cfg.tls_cert_file, cfg.max_model_len, cfg.max_request_bytes) == ("c.pem", 77, 5)
    for cls in CONFIGS:
        assert not hasattr(cls(), "__dict__"), cls
    with pytest.raises(AttributeError):
        cfg.tls_cert_fiel = "typo"  # type: ignore[attr-defined]
    assert {f.name for f in dataclasses.fields(HttpLimits)} <= fields_of(FrontendConfig).keys()


def test_every_field_has_a_group_heading():
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("group"), (cls.__name__, f.name)
    assert {f.metadata["group"] for f in dataclasses.fields(ClientAccess)} == {"endpoint and TLS"}
    assert {f.metadata["group"] for f in dataclasses.fields(ServedModel)} == {"model"}


@pytest.mark.parametrize(
    "argv, headings",
    [
        (
            ["scheduler"],
            ["endpoint and TLS", "cluster", "model", "limits", "scheduling", "failover", "logging"],
        ),
        (["frontend"], ["endpoint and TLS", "cluster", "model", "limits", "logging"]),
        (["worker"], ["cluster", "worker link", "logging", "model", "KV cache", "limits"]),
        (["up"], ["processes", "supervisor", "endpoint and TLS", "model", "limits", "failover"]),
    ],
)
def test_help_groups_flags_under_headings(argv, headings, capsys, monkeypatch):
    text = help_of(argv, capsys, monkeypatch)
    lines = text.splitlines()
    for heading in headings:
        assert lines.count(heading + ":") == 1, (argv, heading)  # one section per heading
    limits = text[text.index("\nlimits:") :]
    assert "--max-num-seqs" in limits or argv == ["frontend"]
    assert "--max-request-bytes" in limits or argv == ["worker"]


def test_one_help_text_per_field_unless_a_role_says_its_own(capsys, monkeypatch):
    sched = help_of(["scheduler"], capsys, monkeypatch)
    front = help_of(["frontend"], capsys, monkeypatch)
    worker = help_of(["worker"], capsys, monkeypatch)
    assert "this scheduler's credentials" in sched
    assert "this front-end's credentials" in front
    assert "this worker's credentials" in worker
    assert "the smaller wins" in sched  # --max-num-seqs, --max-num-batched-tokens
    assert "its own --max-num-seqs" in worker


@pytest.mark.parametrize("cls", CONFIGS)
def test_flags_env_and_argv_round_trip_for_each_config(cls, monkeypatch):
    def parse(argv):
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls)
        return dataclass_from_args(cls, parser.parse_args(argv))

    assert parse([]) == cls()
    name = "model" if "model" in fields_of(cls) else "log_level"  # a group's field
    monkeypatch.setenv("SPLITSERVE_" + name.upper(), "debug")
    changed = parse([])
    assert getattr(changed, name) == "debug"
    assert parse(to_argv(changed)) == changed


def test_group_fields_take_env_vars_on_every_service(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_TLS_CERT_FILE", "/etc/c.pem")
    monkeypatch.setenv("SPLITSERVE_LOG_JSON", "false")
    monkeypatch.setenv("SPLITSERVE_HTTP_MAX_CONNECTIONS", "12")
    for cls in (SchedulerServiceConfig, FrontendConfig):
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls)
        cfg = dataclass_from_args(cls, parser.parse_args([]))
        assert (cfg.tls_cert_file, cfg.log_json, cfg.http_max_connections) == (
            "/etc/c.pem",
            False,
            12,
        )


def test_defaults_are_each_services_own():
    sched, front, link, runner = (cls() for cls in CONFIGS)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (
        128,
        2048,
        4096,
    )
    assert (runner.max_num_seqs, runner.max_num_batched_tokens, runner.max_model_len) == (
        256,
        8192,
        None,
    )
    assert front.max_model_len == 4096 and front.port == sched.port == 50051
    assert (link.max_message_bytes, front.max_message_bytes) == (64 << 20, 4 << 20)
    assert link.scheduler == front.scheduler == "localhost:50052"
