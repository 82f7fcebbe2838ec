"""Start a worker: load the model, size the KV cache, dial the scheduler, serve steps."""

from __future__ import annotations

import os
import signal
import socket

from common.credentials import Credentials, CredentialsError
from common.link_auth import role_credentials, target_host
from common.logging import configure_logging, get_logger
from worker_svc.link import WorkerLinkClient, WorkerLinkConfig
from worker_svc.sim_runner import SimConfig, SimRunner

log = get_logger("splitserve.worker")

OMP_SPIN_COUNT = 300_000  # iterations an idle OpenMP thread spins before sleeping (as libgomp)


def load_credentials(link_cfg: WorkerLinkConfig) -> Credentials | None:
    """The worker's credentials; without them it dials a scheduler on loopback only."""
    if link_cfg.etcd:
        links = {"follow the etcd at": target_host(link_cfg.etcd)}
    else:  # each scheduler of the list (step shards: the worker's own first)
        links = {
            f"dial the scheduler at {address}": target_host(address)
            for address in link_cfg.scheduler.split(",")
        }
    return role_credentials("worker", link_cfg.credentials, links)


def main(link_cfg: WorkerLinkConfig, runner_cfg, sim_cfg: SimConfig | None = None) -> int:
    configure_logging(link_cfg.log_level, link_cfg.log_json)
    # Idle OpenMP threads spin before they sleep. Fully passive waiting is slower because every
    # op then wakes sleeping threads. A long spin keeps them awake across the gaps between a
    # step's ops. On shared cores it does not starve the link: its reader thread takes each step
    # off the stream as it arrives, during the forward, not after it while the threads spin.
    # Set explicitly so that it does not depend on libgomp's default. Must be set before torch
    # loads its OpenMP runtime; OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user win.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
    try:  # before the model loads: a wrong flag fails in a second, not after minutes
        credentials = load_credentials(link_cfg)
    except CredentialsError as exc:
        log.error("worker_refused", reason=f"--credentials: {exc}")
        return 2
    if not link_cfg.worker_id:
        link_cfg.worker_id = f"{socket.gethostname()}-{os.getpid()}"
    if sim_cfg is not None and sim_cfg.simulate:
        runner = SimRunner(
            sim_cfg, runner_cfg.model, runner_cfg.block_size, runner_cfg.max_model_len or 8192
        )
    else:
        from worker_svc.model import UnsupportedModel
        from worker_svc.model_runner import ModelRunner
        from worker_svc.quantization import Unsupported

        try:
            runner = ModelRunner(runner_cfg)
        except (Unsupported, UnsupportedModel) as exc:  # cannot run here: say so, no traceback
            log.error("worker_refused", reason=str(exc))
            return 2
        runner.warm_up(runner_cfg.warmup_tokens)
    log.info(
        "worker_ready",
        worker_id=link_cfg.worker_id,
        model=runner.model_name,
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        forward=getattr(runner, "forward_path", "simulated"),
        kernels=getattr(runner, "kernels", "simulated"),
    )
    client = WorkerLinkClient(link_cfg, runner, credentials)

    def on_signal(signum, frame) -> None:
        log.info("worker_stopping", signal=signal.Signals(signum).name)
        if signum == signal.SIGTERM:
            client.drain()  # finish running requests, then leave
        else:
            client.stop()  # leave now; the scheduler moves the requests elsewhere

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    client.run_forever()
    log.info("worker_stopped", worker_id=client.worker_id, steps=client.num_steps)
    return 0
