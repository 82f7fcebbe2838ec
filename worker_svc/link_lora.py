"""The worker link's LoRA side: the leader's LoraCommands (read an adapter on a thread of its
own, so that no step waits for the files; drop one), the LoraReport answering each, and the
adapters in device slots, sent with a step's result when they changed."""

from __future__ import annotations

import queue
import threading

from common.logging import get_logger
from common.pb import generation_pb2 as gen_pb
from common.pb import worker_link_pb2 as pb

log = get_logger("splitserve.worker")


class LoraCommands:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.resident: list[str] = []  # adapters in device slots, as last reported

    def adapters(self) -> list[gen_pb.LoraAdapter]:
        """The adapters the runner has read (for Register: a new leader learns them here)."""
        listed = getattr(self.runner, "lora_adapters", None)
        return [lora_message(a) for a in listed()] if listed is not None else []

    def note_resident(self, reply: pb.StepResult) -> None:
        resident = getattr(self.runner, "resident_loras", None)
        if resident is None:
            return
        now = list(resident())
        if now != self.resident:
            self.resident = now
            reply.resident_loras.extend(now)
            reply.resident_loras_changed = True

    def handle(self, command: pb.LoraCommand, outbox: queue.SimpleQueue) -> None:
        if command.unload:
            unload = getattr(self.runner, "unload_lora", None)
            if unload is not None:
                unload(command.name)
            report = pb.LoraReport(adapter=gen_pb.LoraAdapter(name=command.name), unload=True)
            outbox.put(pb.WorkerMessage(lora_report=report))
            return
        threading.Thread(
            target=self._load, args=(command, outbox), name="lora-load", daemon=True
        ).start()

    def _load(self, command: pb.LoraCommand, outbox: queue.SimpleQueue) -> None:
        adapter = gen_pb.LoraAdapter(name=command.name, path=command.path)
        error = ""
        try:
            loader = getattr(self.runner, "load_lora", None)
            if loader is None:
                raise ValueError("this worker serves no LoRA adapters (a simulated worker)")
            adapter = lora_message(loader(command.name, command.path))
        except ValueError as exc:  # the runner's LoraLoadError: one sentence
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said to the leader, which refuses the load
            log.exception("lora_load_failed", adapter=command.name)
            error = f"the worker could not read the adapter: {type(exc).__name__}: {exc}"
        if error:
            log.warning("lora_refused", adapter=command.name, error=error)
        else:
            log.info("lora_loaded", adapter=command.name, rank=adapter.rank)
        outbox.put(pb.WorkerMessage(lora_report=pb.LoraReport(adapter=adapter, error=error)))


def lora_message(info) -> gen_pb.LoraAdapter:
    """A runner's LoraInfo (name, path, rank, target_modules) as the wire's LoraAdapter."""
    return gen_pb.LoraAdapter(
        name=info.name,
        path=str(info.path),
        rank=int(info.rank),
        target_modules=list(info.target_modules),
    )
