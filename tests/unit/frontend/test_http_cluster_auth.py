"""/cluster names hosts, pids and addresses: behind the API key when there is one, open when
there is none; `splitserve status --api-key` reads it either way."""

from __future__ import annotations

import argparse
import json

import pytest

from frontend_svc.http import create_app
from splitserve import status
from tests.engine_fakes import http_context, make_engine
from tests.unit.frontend.test_http_server_limits import serving

KEY = "s3cret"
BODY = {
    "model": "fake",
    "epoch": 1,
    "failovers": 0,
    "last_takeover": {},
    "requests_in_flight": 0,
    "waiting": 0,
    "schedulers": [
        {"id": "s1", "host": "h", "pid": 7, "state": "up", "role": "leader", "epoch": 1}
    ],
    "frontends": [],
    "workers": [],
}


def app(api_key: str):
    ctx = http_context(make_engine(), None, api_key, cluster=lambda: BODY)
    return create_app(ctx)


def status_args(port: int, api_key: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    status.add_arguments(parser)
    return parser.parse_args(["--url", f"http://127.0.0.1:{port}", "--json", "--api-key", api_key])


@pytest.mark.parametrize("api_key", [KEY, ""])
def test_cluster_needs_the_key_when_the_server_has_one(api_key, capsys):
    with serving(header_timeout=10, asgi=app(api_key)) as port:
        assert status.run(status_args(port, api_key)) == 0
        assert json.loads(capsys.readouterr().out) == BODY
        code = status.run(status_args(port, ""))
        if api_key:
            assert code == 2
            err = capsys.readouterr().err
            assert "answered 401" in err and "--api-key" in err
            assert status.run(status_args(port, "wrong")) == 2
            assert "answered 401" in capsys.readouterr().err
        else:
            assert code == 0  # no key on the server: open, as every other route
