"""The worker states its capacity in Register: the rows of its batch and the tokens of one
forward pass from its ModelRunnerConfig (0 from a runner without one: the simulated runner),
beside its KV blocks and model length."""

from __future__ import annotations

from types import SimpleNamespace

from worker_svc.config import ModelRunnerConfig
from worker_svc.link import WorkerLinkClient, WorkerLinkConfig


def runner(**extra) -> SimpleNamespace:
    return SimpleNamespace(
        model_name="m",
        block_size=16,
        num_blocks=100,
        num_host_blocks=0,
        max_model_len=2048,
        vocab_size=1000,
        eos_token_id=2,
        **extra,
    )


def test_register_carries_the_runners_rows_and_step_tokens():
    config = ModelRunnerConfig(max_num_seqs=32, max_num_batched_tokens=1024)
    reg = WorkerLinkClient(WorkerLinkConfig(worker_id="w"), runner(config=config)).registration()
    assert (reg.max_num_seqs, reg.max_num_batched_tokens) == (32, 1024)
    assert (reg.num_device_blocks, reg.max_model_len) == (100, 2048)


def test_a_runner_without_a_config_reports_none():
    reg = WorkerLinkClient(WorkerLinkConfig(worker_id="w"), runner()).registration()
    assert (reg.max_num_seqs, reg.max_num_batched_tokens) == (0, 0)
