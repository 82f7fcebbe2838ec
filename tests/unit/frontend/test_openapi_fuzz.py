"""The server against its own /openapi.json: schemathesis generates each operation's parameters
and bodies from the document, and every answer is checked: no 5xx, a status the operation
declares, a declared content type, and a body its schema allows. Streamed answers are checked
event by event against the event schema (the data of an event is a chunk, an error or [DONE], so
its content is not checked further; test_http_api reads the chunks).

In-process, no sockets: the app and the serving engine with a FakeWorker run on an event loop of
their own thread, and each generated case is sent there through httpx's ASGI transport.
Bounded and deterministic: EXAMPLES cases per operation, derandomized, no example database.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.tokenizer import load_tokenizer
from frontend_svc.http import create_app
from frontend_svc.intake import Intake
from scheduler_svc.obs.dashboard_history import DashboardHistory
from scheduler_svc.obs.engine_observer import ObserverGroup
from scheduler_svc.obs.metrics import MetricsObserver
from tests.engine_fakes import (
    TOKENIZER_VOCAB,
    FakeWorker,
    http_context,
    make_engine,
    registration,
    run_session,
)

# a dev extra, skipped without it as the static checks are (tests/unit/test_static_checks.py)
schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[dev]'")
conformance = pytest.importorskip("schemathesis.specs.openapi.checks")
FailureGroup = pytest.importorskip("schemathesis.core.failures").FailureGroup

KEY = "fuzz-key"
CHECKS = [
    schemathesis.checks.not_a_server_error,
    conformance.status_code_conformance,
    conformance.content_type_conformance,
    conformance.response_schema_conformance,
]
EXAMPLES = 25  # the generation routes; the others take few inputs
FEW_EXAMPLES = 8
GENERATION = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
# an endless event stream (the dashboard's, one event a second until the client leaves)
NOT_FUZZED = {("GET", "/dashboard/api/events")}
REQUEST_TIMEOUT_S = 30.0


class Served:
    """The app with an API key, metrics, the dashboard and a leader's /cluster, in front of a
    serving engine with one FakeWorker, on an event loop in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(REQUEST_TIMEOUT_S)

    async def _start(self) -> None:
        engine = make_engine(TOKENIZER_VOCAB)
        intake = Intake(load_tokenizer(None), "fake", {"fake"}, 512)
        metrics, history = MetricsObserver(engine), DashboardHistory(engine)
        engine.observer = ObserverGroup(metrics, history)
        ctx = http_context(
            engine, intake, KEY, metrics, history, cluster=lambda: {"schedulers": []}
        )
        self.session = engine.attach(
            registration("w0", num_blocks=256), FakeWorker(vocab_size=TOKENIZER_VOCAB)
        )
        self.task = asyncio.create_task(run_session(engine, self.session))
        transport = httpx.ASGITransport(app=create_app(ctx))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test")

    async def _stop(self) -> None:
        await self.client.aclose()
        self.session.mark_lost("test over")
        await self.task

    def close(self) -> None:
        self.call(self._stop())
        # the routes build requests in the loop's executor threads: wait for them all, so no
        # work of this module's still runs while the next module's tests do
        self.call(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def send(self, case: schemathesis.Case) -> httpx.Response:
        sent = case.as_transport_kwargs(base_url="http://test")
        body = {"json": sent["json"]} if "json" in sent else {"content": sent.get("data")}
        request = self.client.request(
            sent["method"],
            sent["url"],
            params=sent.get("params"),
            headers=dict(sent["headers"]),
            **body,
        )
        return self.call(request)


@pytest.fixture(scope="module")
def served():
    served = Served()
    yield served
    served.close()


def fuzz(served: Served, operation) -> None:
    """EXAMPLES generated cases of one operation, each sent and checked; raises on the first
    answer that fails a check (after hypothesis shrinks the case)."""
    many = operation.path in GENERATION
    strategy = operation.as_strategy(headers={"Authorization": f"Bearer {KEY}"})

    @settings(
        max_examples=EXAMPLES if many else FEW_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,  # a loaded CI machine must not turn slowness into a failure
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=strategy, stream=st.booleans())
    def check(case: schemathesis.Case, stream: bool) -> None:
        if stream and many and isinstance(case.body, dict):
            # an optional field the generator seldom draws: half the bodies ask for a stream
            case.body["stream"] = True
        case.validate_response(served.send(case), checks=CHECKS)

    check()


def test_every_answer_is_one_the_openapi_document_declares(served):
    document = served.call(served.client.get("/openapi.json", headers=_auth()))
    assert document.status_code == 200, document.text
    schema = schemathesis.openapi.from_dict(document.json())
    fuzzed, failures = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in NOT_FUZZED:
            continue
        fuzzed.append(f"{operation.method.upper()} {operation.path}")
        try:
            fuzz(served, operation)
        except (FailureGroup, Exception) as exc:  # noqa: BLE001 - every operation's, together
            failures.append(f"{fuzzed[-1]}:\n{exc}")
    assert not failures, "\n\n".join(failures)
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"):
        assert route in fuzzed


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}
