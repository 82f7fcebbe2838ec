"""The worker's side of the WorkerLink: dial, register, execute steps, reconnect on loss.

Across a scheduler failover: a lost link forgets the runner's rows but keeps its KV cache, and
the next Register reports the rows it had (real request ids, block tables, tokens computed) for
the new leader to adopt. Every leader message carries its epoch; the worker refuses (closes the
link on) one older than the highest it has accepted. With --etcd it follows the leader there.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import grpc

from common.config_groups import RUNTIME, Cluster, LeaderAddress, Logging, config_group, opt
from common.convert import decode_step, encode_step_result
from common.credentials import Credentials
from common.gc_tuning import tune_gc_for_serving
from common.link_auth import PlaintextRefused, scheduler_channel
from common.logging import get_logger
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from worker_svc.link_lora import LoraCommands

log = get_logger("splitserve.worker")


@config_group("worker link")
class WorkerLink:
    worker_id: str = opt("", "this worker's id (default: host-pid)")
    heartbeat_interval: float = opt(2.0, "seconds between heartbeats")
    reconnect_max_backoff: float = opt(10.0, "longest wait between reconnect attempts")
    drain_timeout: float = opt(30.0, "on SIGTERM: seconds to finish running requests")
    measure_costs: bool = opt(
        True,
        "time verification steps of 1 to 64 tokens at start (speculative decoding sizes its "
        "drafts by them) and, with host blocks, a prefill and a block copy; report them",
    )
    max_message_bytes: int = opt(
        64 * 1024 * 1024, "largest gRPC message accepted on the worker link"
    )
    tune_gc: bool = opt(
        True,
        "freeze what exists at start (the model) out of GC and collect young objects less "
        "often: full collections otherwise walk it all, several times a second",
        group=RUNTIME,
    )


@dataclass(slots=True)
class WorkerLinkConfig(LeaderAddress, Cluster, WorkerLink, Logging):
    FIELD_HELP: ClassVar[dict[str, str]] = {
        "credentials": "directory of this worker's credentials (ca.crt, tls.crt, tls.key): "
        "mutual TLS to the scheduler (only a certificate naming splitserve-scheduler is "
        "trusted) and to etcd. Required unless the scheduler is on loopback",
    }


class WorkerLinkClient:
    """Holds one stream to the scheduler at a time; runs `runner.execute_model` per Step."""

    def __init__(
        self, cfg: WorkerLinkConfig, runner, credentials: Credentials | None = None
    ) -> None:
        self.cfg = cfg
        self.runner = runner
        self.credentials = credentials  # None: plaintext, to a scheduler on loopback only
        self.worker_id = cfg.worker_id
        self.stopping = threading.Event()
        self.draining = False
        self._call = None
        self._outbox: queue.SimpleQueue | None = None
        self._attached = False
        self.num_steps = 0
        self._last_reply_at: float | None = None  # perf_counter when the last result was sent
        self._costs: dict | None = None  # measured once, sent with every registration
        self.epoch = 0  # the highest leader epoch accepted (fencing)
        self._request_ids: dict[str, str] = {}  # the runner's row key (str(handle)) -> real id
        self._held: list[pb.HeldRequest] = []  # rows when the last link broke, for Register
        self._session_steps = 0
        self._wake = threading.Event()  # ends a reconnect wait early (stop, switch)
        self.loras = LoraCommands(runner)  # LoRA adapters: read, dropped, reported
        # --scheduler A,B,...: step shards; A is this worker's, the others take it (and the
        # rows it holds) when A refuses
        self._addresses = [a.strip() for a in cfg.scheduler.split(",") if a.strip()]
        if self._addresses:
            cfg.scheduler = self._addresses[0]

    def registration(self) -> pb.Register:
        r = self.runner
        eos = r.eos_token_id
        limits = getattr(r, "config", None)  # a ModelRunner's; a simulated runner has none (0)
        return pb.Register(
            worker_id=self.worker_id,
            model=r.model_name,
            block_size=r.block_size,
            num_device_blocks=r.num_blocks,
            num_host_blocks=r.num_host_blocks,
            max_model_len=r.max_model_len,
            max_num_seqs=getattr(limits, "max_num_seqs", 0),
            max_num_batched_tokens=getattr(limits, "max_num_batched_tokens", 0),
            max_loras=getattr(limits, "max_loras", 0),
            max_lora_rank=getattr(limits, "max_lora_rank", 0),
            loras=self.loras.adapters(),
            resident_loras=self.loras.resident,
            vocab_size=r.vocab_size,
            eos_token_id=-1 if eos is None else eos,
            device=str(getattr(r, "device", "")),
            dtype=str(getattr(r, "dtype", "")),
            kernels=getattr(r, "kernels", "simulated"),
            host=socket.gethostname(),
            pid=os.getpid(),
            epoch=self.epoch,
            held=self._held,
            **self.costs(),
        )

    def costs(self) -> dict:
        """Measured preemption costs (worker_svc/cost_probe.py), once; {} when not measured."""
        if self._costs is None:
            self._costs = {}
            if self.cfg.measure_costs and hasattr(self.runner, "kv_cache"):
                from worker_svc.cost_probe import measure_costs  # torch: only real runners

                try:
                    self._costs = measure_costs(self.runner)
                except Exception:  # noqa: BLE001 - the scheduler then uses its defaults
                    log.exception("cost_probe_failed")
                if self._costs:
                    log.info("costs_measured", **{k: _rounded(v) for k, v in self._costs.items()})
        return self._costs

    def stop(self) -> None:
        """Leave now: in-flight requests move to other workers by recompute."""
        self.stopping.set()
        self._wake.set()
        call = self._call
        if call is not None:
            call.cancel()

    def switch_scheduler(self, address: str) -> None:
        """Dial `address` from now on: the current link is closed and the next one opened at
        once, without the reconnect backoff (the leader changed)."""
        log.info("switching_scheduler", scheduler=address, previous=self.cfg.scheduler)
        self.cfg.scheduler = address
        self._wake.set()
        call = self._call  # read after the address is set: see _run_session
        if call is not None:
            call.cancel()

    def _capture_held(self) -> None:
        """Before runner.reset(): the rows the runner holds, by real request id."""
        ids = self._request_ids
        self._held = [
            pb.HeldRequest(
                request_id=ids.get(key, key),
                block_ids=block_ids,
                num_computed_tokens=num_computed,
                num_tokens=num_tokens,
            )
            for key, block_ids, num_computed, num_tokens in self.runner.held_requests()
        ]

    def drain(self) -> None:
        """Leave gracefully: take no new requests, finish the running ones (within
        drain_timeout; the scheduler hands back the rest), then stop."""
        outbox = self._outbox
        if self.draining or outbox is None or not self._attached:
            self.stop()
            return
        self.draining = True
        timeout = self.cfg.drain_timeout
        log.info("draining", worker_id=self.worker_id, timeout_s=timeout)
        outbox.put(pb.WorkerMessage(drain=pb.Drain(timeout_s=timeout)))
        timer = threading.Timer(timeout + 10.0, self.stop)  # the scheduler did not answer
        timer.daemon = True
        timer.start()

    def run_forever(self) -> None:
        if self.cfg.tune_gc:  # as the scheduler does (splitserve/scheduler_process.py)
            tune_gc_for_serving()
        watcher = self._follow_leader() if self.cfg.etcd else None
        try:
            self._reconnect_loop()
        finally:
            if watcher is not None:
                watcher.stop()

    def _next_address(self, tried: int) -> bool:
        """After a session that never attached: dial the next scheduler of --scheduler's list
        now, unless each was tried since the last attach. Returns whether it moved on."""
        if len(self._addresses) < 2 or tried >= len(self._addresses) - 1:
            return False
        here = self.cfg.scheduler
        k = self._addresses.index(here) if here in self._addresses else -1
        self.cfg.scheduler = self._addresses[(k + 1) % len(self._addresses)]
        log.info("trying_next_scheduler", scheduler=self.cfg.scheduler, previous=here)
        return True

    def _reconnect_loop(self) -> None:
        backoff = 0.25
        tried = 0  # other addresses dialed since the last attach
        while not self.stopping.is_set():
            self._wake.clear()
            attached = self._run_session()
            if self.stopping.is_set() or self.draining:
                break
            if self._session_steps:  # else the rows (and the KV) are as last reported
                self._capture_held()
            self.runner.reset()
            self._request_ids.clear()
            if attached:
                backoff, tried = 0.25, 0
            if self._wake.is_set():  # switched to a new leader: dial it now
                continue
            if not attached and self._next_address(tried):
                tried += 1
                continue
            tried = 0
            wait = min(self.cfg.reconnect_max_backoff, backoff) * (0.75 + random.random() / 2)
            log.info("reconnecting", scheduler=self.cfg.scheduler, wait_s=round(wait, 2))
            self._wake.wait(wait)
            backoff = min(self.cfg.reconnect_max_backoff, backoff * 2)

    def _follow_leader(self):
        """Watch etcd for the leader and switch to each new one; wait for the first."""
        from common.leader_watcher import LeaderWatcherThread  # etcd client: only with --etcd

        def on_change(leader) -> None:
            if leader is None:
                log.warning("no_leader", etcd=self.cfg.etcd)
            elif leader.epoch < self.epoch:
                log.warning("fenced", epoch=leader.epoch, accepted=self.epoch, source="etcd")
            else:
                self.switch_scheduler(leader.info["worker_address"])

        watcher = LeaderWatcherThread(self.cfg.etcd, on_change, credentials=self.credentials)
        watcher.start()
        log.info("waiting_for_leader", etcd=self.cfg.etcd)
        while not self.stopping.is_set() and watcher.wait_for_leader(1.0) is None:
            pass
        return watcher

    def _run_session(self) -> bool:
        """One connection. Returns whether it got as far as being registered."""
        options = [
            ("grpc.max_receive_message_length", self.cfg.max_message_bytes),
            ("grpc.max_send_message_length", self.cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
        ]
        cfg = self.cfg
        address = cfg.scheduler
        try:
            channel = scheduler_channel(address, self.credentials, options)
        except PlaintextRefused as exc:  # a leader named in etcd beyond loopback
            log.error("refused_plaintext_link", scheduler=address, message=str(exc))
            return False
        # SimpleQueue: its put is reentrant, so drain() may put from the SIGTERM handler even
        # when the signal lands while this thread is inside a put (queue.Queue deadlocks then)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        outbox.put(pb.WorkerMessage(register=self.registration()))
        self._attached = False
        self._outbox = outbox
        self._last_reply_at = None
        self._session_steps = 0
        done = threading.Event()

        def requests():
            while True:
                msg = outbox.get()
                if msg is None:
                    return
                yield msg

        def heartbeats():
            while not done.wait(self.cfg.heartbeat_interval):
                outbox.put(pb.WorkerMessage(heartbeat=pb.Heartbeat(time=time.time())))

        attached = False
        with channel:
            stub = pb_grpc.WorkerLinkStub(channel)
            self._call = call = stub.Connect(requests())
            if cfg.scheduler != address:  # switched before the call could be cancelled
                call.cancel()
            threading.Thread(target=heartbeats, daemon=True).start()
            # a reader thread takes each message off the stream as soon as it arrives, so the
            # next (pipelined) step is already decoded when this one is done: the main thread
            # goes from one step to the next without a gRPC receive round in between
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_read_stream, args=(call, inbox), daemon=True).start()
            try:
                while (msg := inbox.get()) is not None:
                    if isinstance(msg, grpc.RpcError):
                        raise msg
                    kind = msg.WhichOneof("msg")
                    if kind == "register_ack":
                        if not self._accept_epoch(msg.register_ack.epoch, "register_ack"):
                            break
                        attached = self._attached = True
                        self.worker_id = msg.register_ack.worker_id
                        log.info(
                            "registered",
                            worker_id=self.worker_id,
                            scheduler=address,
                            epoch=self.epoch,
                            held=len(self._held),
                        )
                    elif kind == "step":
                        if not self._accept_epoch(msg.step.epoch, "step"):
                            break
                        self._session_steps += 1
                        outbox.put(pb.WorkerMessage(step_result=self._execute(msg.step)))
                    elif kind == "lora_command":
                        self.loras.handle(msg.lora_command, outbox)
                    elif kind == "drained":
                        log.info(
                            "drained",
                            worker_id=self.worker_id,
                            finished=msg.drained.num_finished,
                            handed_back=msg.drained.num_handed_back,
                        )
                        self.stopping.set()
                        break
            except grpc.RpcError as exc:
                if not self.stopping.is_set():
                    log.warning("link_lost", code=str(exc.code()), detail=exc.details())
            finally:
                call.cancel()  # a no-op once the stream has ended; else the scheduler sees it end
                done.set()
                outbox.put(None)
                self._call = None
                self._outbox = None
                self._attached = False
        return attached

    def _accept_epoch(self, epoch: int, what: str) -> bool:
        """Fencing: a leader older than one already accepted is refused (False)."""
        if epoch < self.epoch:
            log.warning("fenced", message=what, epoch=epoch, accepted=self.epoch)
            return False
        self.epoch = epoch
        return True

    def _execute(self, step: pb.Step) -> pb.StepResult:
        started = time.perf_counter()
        idle = started - self._last_reply_at if self._last_reply_at is not None else 0.0
        ids = self._request_ids
        for handle in step.finished:
            ids.pop(str(handle), None)
        for new in step.new_requests:
            ids[str(new.handle)] = new.request_id or str(new.handle)
        out = decode_step(step)
        try:
            result = self.runner.execute_model(out)
        except Exception as exc:  # report, and let the scheduler decide
            log.exception("step_failed", step_id=step.step_id)
            return pb.StepResult(step_id=step.step_id, error=f"{type(exc).__name__}: {exc}")
        self.num_steps += 1
        reply = encode_step_result(
            step.step_id,
            result.sampled_token_ids,
            _logprobs(result),
            forward_time_s=result.forward_time_s,
            sample_time_s=result.sample_time_s,
            step_time_s=time.perf_counter() - started,
        )
        reply.idle_time_s = idle
        self.loras.note_resident(reply)
        self._last_reply_at = time.perf_counter()
        return reply


def _rounded(value):
    return [round(v, 6) for v in value] if isinstance(value, list) else round(value, 9)


def _read_stream(call, inbox: queue.SimpleQueue) -> None:
    """Move the scheduler's messages into `inbox`; then None, after the RpcError if any."""
    try:
        for msg in call:
            inbox.put(msg)
    except grpc.RpcError as exc:
        inbox.put(exc)
    except Exception as exc:  # noqa: BLE001 - the main thread must hear the stream is over
        log.warning("link_reader_failed", error=f"{type(exc).__name__}: {exc}")
    inbox.put(None)


def _logprobs(result):
    return getattr(result, "logprobs", None) or None
