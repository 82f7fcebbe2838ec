"""Flags and SPLITSERVE_* environment variables derive from the config dataclasses."""

import argparse

import pytest

from common.settings import add_dataclass_args, dataclass_from_args, to_argv
from scheduler_svc.config import SchedulerServiceConfig


def parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, SchedulerServiceConfig)
    return dataclass_from_args(SchedulerServiceConfig, parser.parse_args(argv))


def test_defaults_flags_and_env(monkeypatch):
    assert parse([]).port == 50051
    assert parse(["--max-num-seqs", "7"]).max_num_seqs == 7
    cfg = parse(
        [],
        monkeypatch,
        {"SPLITSERVE_MAX_NUM_SEQS": "9", "SPLITSERVE_ENABLE_PREFIX_CACHING": "false"},
    )
    assert cfg.max_num_seqs == 9 and cfg.enable_prefix_caching is False
    # a flag beats the environment
    assert (
        parse(["--max-num-seqs", "3"], monkeypatch, {"SPLITSERVE_MAX_NUM_SEQS": "9"}).max_num_seqs
        == 3
    )
    assert parse(["--no-enable-chunked-prefill"]).enable_chunked_prefill is False


def test_bad_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit, match="SPLITSERVE_ENABLE_PREFIX_CACHING"):
        parse([])


def test_to_argv_round_trips():
    cfg = SchedulerServiceConfig(port=1234, enable_prefix_caching=False, model="m")
    assert parse(to_argv(cfg)) == cfg
