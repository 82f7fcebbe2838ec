"""The leader's LoRA adapters: which exist (name -> path), which each worker has read, and
loading and unloading them on every worker that serves adapters (--max-loras above 0).

Loading is all or nothing: every such worker reads and checks the files (in the background:
none of its steps waits), and if one refuses them (another base model, a rank over its
--max-lora-rank, files missing or corrupt) those that took them drop them again and the caller
hears that worker's sentence. A worker that attaches later is told to read every adapter the
leader knows; a new leader learns the adapters from its workers' registrations (they keep the
paths). Unloading takes the name away from new requests at once; the workers drop the weights
once no request with it is left in flight.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.logging import get_logger
from common.outcomes import LoraAdapterError
from scheduler_svc.core import RequestStatus

if TYPE_CHECKING:
    from scheduler_svc.engine.engine_host import EngineHost

log = get_logger("splitserve.lora")

LOAD_TIMEOUT_S = 120.0
UNLOAD_POLL_S = 0.25
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")
MAX_PATH_LEN = 4096


@dataclass(slots=True, frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int = 0
    target_modules: tuple[str, ...] = ()


def adapter_from_message(message: Any) -> LoraAdapter:
    """The wire's LoraAdapter (generation.proto) as the registry's."""
    return LoraAdapter(message.name, message.path, message.rank, tuple(message.target_modules))


@dataclass(slots=True)
class LoraUsage:
    """The adapters of the running and of the waiting requests, and the most slots a worker
    has (LoraRegistry.usage reads them off the engine)."""

    max_loras: int = 0
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


class LoraRegistry:
    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine
        self.adapters: dict[str, LoraAdapter] = {}  # what requests may name
        # which adapters each worker has read is its session's available_loras
        self._pending: dict[tuple[str, str], asyncio.Future] = {}  # (worker, name) -> report
        # unloaded, requests with it still running: the task that drops it from the workers
        self._draining: dict[str, asyncio.Task] = {}

    # ---- what placement and admission ask ---------------------------------------------------
    def serves(self, name: str) -> bool:
        return name in self.adapters

    def describe(self) -> list[LoraAdapter]:
        return sorted(self.adapters.values(), key=lambda a: a.name)

    def usage(self) -> LoraUsage:
        """The adapters of the running and of the waiting requests (vllm:lora_requests_info):
        a request runs once its worker's core has admitted it."""
        running, waiting = set(), set()
        for state in self.engine.requests.values():
            if state.lora_name:
                core = state.core
                admitted = core is not None and core.status is RequestStatus.RUNNING
                (running if admitted and state.worker_id else waiting).add(state.lora_name)
        slots = [s.max_loras for s in self.engine.sessions.values()]
        return LoraUsage(max(slots, default=0), tuple(sorted(running)), tuple(sorted(waiting)))

    # ---- workers ------------------------------------------------------------------------------
    def worker_attached(self, session: Any, reported: list[LoraAdapter]) -> None:
        """A worker registered with the adapters it has read: it is told to read the others,
        and the workers already here to read those only it had (--lora-modules given to some
        workers, or a new leader learning them from its workers in any order)."""
        held = session.available_loras = {a.name for a in reported}
        learned = self.learn(reported)
        for other in self.engine._live_sessions():
            if other is not session and self._takes_adapters(other):
                for adapter in learned:
                    if adapter.name not in other.available_loras:
                        self._send(other, adapter)
        if self._takes_adapters(session):
            for name, adapter in self.adapters.items():
                if name not in held:
                    self._send(session, adapter)  # its report adds it to the worker's

    def learn(self, adapters: list[LoraAdapter]) -> list[LoraAdapter]:
        """Adapters a worker has read: a new leader learns them from its workers' reports.
        Returns those new here."""
        learned = []
        for adapter in adapters:
            if adapter.name not in self.adapters and adapter.name not in self._draining:
                self.adapters[adapter.name] = adapter
                learned.append(adapter)
        return learned

    def worker_detached(self, session: Any) -> None:
        wid = session.worker_id
        for (worker, name), future in list(self._pending.items()):
            if worker == wid:
                del self._pending[(worker, name)]
                if not future.done():
                    future.set_result(None)

    def on_report(self, session: Any, report: Any) -> None:
        """A worker's LoraReport: an adapter read (or refused, with why) or dropped."""
        wid, name = session.worker_id, report.adapter.name
        held = session.available_loras
        if report.unload:
            held.discard(name)
            return
        if not report.error:
            held.add(name)
        future = self._pending.pop((wid, name), None)
        if future is not None and not future.done():
            future.set_result(report)
        elif report.error:
            log.warning("lora_load_refused", worker_id=wid, adapter=name, error=report.error)

    # ---- the API --------------------------------------------------------------------------
    async def load(self, name: str, path: str) -> LoraAdapter:
        """Read `path` as adapter `name` on every worker that serves adapters; raises
        LoraAdapterError."""
        self._check_name(name)
        if not path or len(path) > MAX_PATH_LEN or "\0" in path:
            raise LoraAdapterError(
                "INVALID_ARGUMENT", "lora_path must name the adapter's directory"
            )
        if name in self.adapters:
            raise LoraAdapterError(
                "ALREADY_EXISTS",
                f"the LoRA adapter {name!r} is already loaded; unload it first to load it again",
            )
        if name in self._draining:
            raise LoraAdapterError(
                "FAILED_PRECONDITION",
                f"the LoRA adapter {name!r} is still being unloaded (requests with it are "
                f"finishing); retry in a moment",
            )
        if self.engine.remote_workers:
            raise LoraAdapterError(
                "FAILED_PRECONDITION",
                "adapters are loaded at run time only where the leader steps its workers "
                "itself; with step shards give the workers --lora-modules at start",
            )
        workers = [s for s in self.engine._live_sessions() if self._takes_adapters(s)]
        if not workers:
            raise LoraAdapterError(
                "FAILED_PRECONDITION",
                "no worker serves LoRA adapters: start workers with --max-loras N (N > 0)",
            )
        adapter = LoraAdapter(name, path)
        futures = [self._send(s, adapter) for s in workers]
        try:
            reports = await asyncio.wait_for(asyncio.gather(*futures), LOAD_TIMEOUT_S)
        except TimeoutError:
            reports = [None] * len(workers)
        took = [s for s, r in zip(workers, reports, strict=True) if r is not None and not r.error]
        refusal = next((r for r in reports if r is not None and r.error), None)
        if refusal is not None or len(took) < len(workers):
            for session in took:  # nothing stays half-loaded
                await self._send_unload(session, name)
            if refusal is not None:
                raise LoraAdapterError("INVALID_ARGUMENT", refusal.error)
            raise LoraAdapterError(
                "UNAVAILABLE",
                f"a worker left or did not answer within {LOAD_TIMEOUT_S:g} s while loading "
                f"{name!r}; retry",
            )
        first = next(r for r in reports if r is not None)
        loaded = LoraAdapter(name, path, first.adapter.rank, tuple(first.adapter.target_modules))
        self.adapters[name] = loaded
        log.info("lora_loaded", adapter=name, path=path, rank=loaded.rank, workers=len(took))
        return loaded

    def unload(self, name: str) -> int:
        """Take `name` away from new requests; the workers drop it once no request with it is
        in flight. Returns how many are; raises LoraAdapterError (NOT_FOUND)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraAdapterError("NOT_FOUND", f"no LoRA adapter {name!r} is loaded")
        in_flight = self._in_flight(name)
        self._draining[name] = asyncio.get_running_loop().create_task(self._drop_when_idle(name))
        log.info("lora_unloading", adapter=name, in_flight=in_flight)
        return in_flight

    # ---- helpers --------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if not NAME_PATTERN.fullmatch(name or ""):
            raise LoraAdapterError(
                "INVALID_ARGUMENT",
                "lora_name must be 1 to 128 letters, digits and . _ / : - (starting with a "
                "letter or digit)",
            )
        if name == self.engine.model_name:
            raise LoraAdapterError(
                "INVALID_ARGUMENT", f"lora_name {name!r} is the base model's name; choose another"
            )

    @staticmethod
    def _takes_adapters(session: Any) -> bool:
        return (
            session.max_loras > 0 and hasattr(session.transport, "send_lora") and session.accepting
        )

    def _in_flight(self, name: str) -> int:
        return sum(1 for s in self.engine.requests.values() if s.lora_name == name)

    def _send(self, session: Any, adapter: LoraAdapter) -> asyncio.Future:
        """Tell `session` to read `adapter`; the future gets its report (None if it left)."""
        key = (session.worker_id, adapter.name)
        future = self._pending.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._pending[key] = future

            async def send() -> None:
                try:
                    await session.transport.send_lora(adapter.name, adapter.path, unload=False)
                except Exception as exc:  # noqa: BLE001 - the worker is gone: no report comes
                    log.warning("lora_command_failed", worker_id=session.worker_id, error=str(exc))
                    if self._pending.pop(key, None) is future and not future.done():
                        future.set_result(None)

            asyncio.get_running_loop().create_task(send())
        return future

    async def _send_unload(self, session: Any, name: str) -> None:
        session.available_loras.discard(name)
        try:
            await session.transport.send_lora(name, "", unload=True)
        except Exception as exc:  # noqa: BLE001 - a worker that left has dropped it anyway
            log.warning("lora_command_failed", worker_id=session.worker_id, error=str(exc))

    async def _drop_when_idle(self, name: str) -> None:
        while self._in_flight(name):
            await asyncio.sleep(UNLOAD_POLL_S)
        holders = [s for s in self.engine._live_sessions() if name in s.available_loras]
        for session in holders:
            await self._send_unload(session, name)
        self._draining.pop(name, None)  # only now may the name be loaded again
        log.info("lora_unloaded", adapter=name, workers=len(holders))
