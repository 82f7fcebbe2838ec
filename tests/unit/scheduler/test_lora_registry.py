"""The leader's adapter registry over fake workers that read adapters (no gRPC, no model):
loading is all or nothing, later workers are told to read what the leader knows, a new leader
learns the adapters from registrations, unloading waits for the requests in flight, and
requests go only to workers that have read their adapter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.outcomes import LoraAdapterError, RequestRejected
from scheduler_svc.engine.lora_registry import LoraAdapter
from tests.engine_fakes import FakeWorker, drain, make_engine, make_state, reference, registration


class LoraWorker(FakeWorker):
    """Reads an adapter when told (refusing the paths in `refuse`) and reports it back, as a
    worker's link does from its loading thread."""

    def __init__(self, refuse: set[str] = frozenset(), **kw) -> None:
        super().__init__(**kw)
        self.refuse = refuse
        self.commands: list[tuple[str, str, bool]] = []
        self.on_report = None
        self.lora_names: list[str] = []  # the adapter of each new request, as sent

    async def send_lora(self, name: str, path: str, unload: bool) -> None:
        self.commands.append((name, path, unload))
        error = (
            f"LoRA adapter {name!r} at {path}: rank 32 > max_lora_rank 16"
            if (path in self.refuse)
            else ""
        )
        report = SimpleNamespace(
            adapter=SimpleNamespace(name=name, path=path, rank=8, target_modules=["q_proj"]),
            error=error,
            unload=unload,
        )
        asyncio.get_running_loop().call_soon(self.on_report, report)

    async def execute(self, out):
        self.lora_names += [new.lora_name for new in out.new_requests]
        return await super().execute(out)


def attach(engine, wid: str, worker: LoraWorker, max_loras: int = 2, held=()):
    reg = registration(wid)
    reg.max_loras = max_loras
    reg.loras = [LoraAdapter(n, f"/a/{n}", 8) for n in held]
    session = engine.attach(reg, worker)
    worker.on_report = lambda report: engine.loras.on_report(session, report)
    return session


def test_a_load_every_worker_takes_is_served_and_placed_only_where_read():
    async def main():
        engine = make_engine()
        lora_workers = [LoraWorker(), LoraWorker()]
        sessions = [attach(engine, f"w{i}", w) for i, w in enumerate(lora_workers)]
        base_only = attach(engine, "w-base", LoraWorker(), max_loras=0)
        adapter = await engine.loras.load("sql", "/a/sql")
        assert adapter.rank == 8 and engine.loras.serves("sql")
        assert all(w.commands == [("sql", "/a/sql", False)] for w in lora_workers)
        assert all("sql" in s.available_loras for s in sessions)
        assert not base_only.available_loras
        tasks = [asyncio.create_task(engine.run_worker(s)) for s in (*sessions, base_only)]
        states = [make_state(f"r{i}", [3, 4, 5, i], 6) for i in range(6)]
        for state in states:
            state.lora_name = "sql"
            engine.submit(state)
        results = await asyncio.gather(*(drain(s) for s in states))
        for state, (tokens, _) in zip(states, results, strict=True):
            assert tokens == reference(state.prompt_token_ids, 6)
        sent = [n for w in lora_workers for n in w.lora_names]
        assert sent.count("sql") == 6  # every one ran with its adapter, on a worker that read it
        for t in tasks:
            t.cancel()

    asyncio.run(main())


def test_a_load_one_worker_refuses_leaves_nothing_loaded():
    async def main():
        engine = make_engine()
        taker, refuser = LoraWorker(), LoraWorker(refuse={"/a/wide"})
        s0, s1 = attach(engine, "w0", taker), attach(engine, "w1", refuser)
        with pytest.raises(LoraAdapterError) as err:
            await engine.loras.load("wide", "/a/wide")
        assert err.value.code == "INVALID_ARGUMENT" and "rank 32" in str(err.value)
        assert taker.commands[-1] == ("wide", "", True)  # the one that took it dropped it
        assert not engine.loras.serves("wide")
        assert "wide" not in s0.available_loras | s1.available_loras
        state = make_state("r", [1, 2, 3], 2)
        state.lora_name = "wide"
        with pytest.raises(RequestRejected, match="wide"):
            engine.submit(state)

    asyncio.run(main())


def test_refusals_with_a_sentence():
    async def main():
        engine = make_engine()
        with pytest.raises(LoraAdapterError, match="--max-loras") as err:
            await engine.loras.load("sql", "/a/sql")  # no worker has slots
        assert err.value.code == "FAILED_PRECONDITION"
        attach(engine, "w0", LoraWorker())
        for name, code in (("", "INVALID_ARGUMENT"), ("bad name", "INVALID_ARGUMENT")):
            with pytest.raises(LoraAdapterError) as err:
                await engine.loras.load(name, "/a/x")
            assert err.value.code == code
        await engine.loras.load("sql", "/a/sql")
        with pytest.raises(LoraAdapterError, match="already loaded") as err:
            await engine.loras.load("sql", "/a/other")
        assert err.value.code == "ALREADY_EXISTS"
        with pytest.raises(LoraAdapterError) as err:
            engine.loras.unload("nope")
        assert err.value.code == "NOT_FOUND"

    asyncio.run(main())


def test_a_later_worker_reads_what_the_leader_knows_and_a_new_leader_learns_from_workers():
    async def main():
        engine = make_engine()
        attach(engine, "w0", LoraWorker(), held=("chat",))  # a new leader: learnt from it
        assert engine.loras.serves("chat")
        late = LoraWorker()
        session = attach(engine, "w1", late)
        await asyncio.sleep(0.01)
        assert late.commands == [("chat", "/a/chat", False)]
        assert "chat" in session.available_loras
        # one attached before the worker that had it: told to read it then
        early = LoraWorker()
        engine2 = make_engine()
        first = attach(engine2, "w0", early)
        attach(engine2, "w1", LoraWorker(), held=("sql",))
        await asyncio.sleep(0.01)
        assert early.commands == [("sql", "/a/sql", False)]
        assert "sql" in first.available_loras

    asyncio.run(main())


def test_unload_takes_the_name_at_once_and_drops_it_from_workers_once_idle():
    async def main():
        engine = make_engine()
        worker = LoraWorker()
        session = attach(engine, "w0", worker)
        await engine.loras.load("sql", "/a/sql")
        running = make_state("r", [1, 2, 3], 4)
        running.lora_name = "sql"
        engine.submit(running)
        assert engine.loras.unload("sql") == 1  # one request still in flight with it
        assert not engine.loras.serves("sql")
        late = make_state("late", [1, 2, 3], 4)
        late.lora_name = "sql"
        with pytest.raises(RequestRejected):
            engine.submit(late)
        await asyncio.sleep(0.6)
        assert ("sql", "", True) not in worker.commands  # not while it runs
        task = asyncio.create_task(engine.run_worker(session))
        tokens, _ = await drain(running)
        assert tokens == reference([1, 2, 3], 4)
        await asyncio.sleep(0.6)
        assert worker.commands[-1] == ("sql", "", True)
        assert "sql" not in session.available_loras
        task.cancel()

    asyncio.run(main())
