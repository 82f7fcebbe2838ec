"""The dashboard page in headless Chromium: its script runs, polls the scheduler, shows w0.

Needs Debian's `chromium` (apt-get install -y chromium); skipped with a reason without it.
Set SPLITSERVE_UPDATE_DOCS=1 to refresh docs/dashboard.png from the screenshot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import httpx
import pytest

from tests.e2e.http_cluster import AUTH, shared_http_cluster
from tests.e2e.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_http_cluster(tmp_path_factory)


def chromium(tmp_path, url: str, *mode: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1280,900",
            "--virtual-time-budget=4000",
            *mode,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def load(cluster, n: int = 6) -> None:
    """A few concurrent requests of different lengths, so the charts have steps to draw."""

    def one(i: int) -> None:
        httpx.post(
            cluster.url("/v1/completions"),
            headers=AUTH,
            json={
                "prompt": "Tell me about scheduling. " * (1 + 3 * i),
                "max_tokens": 6 + 2 * i,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
            },
            timeout=120,
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)


@needs_chromium
def test_dashboard_shows_the_worker_live(cluster, tmp_path):
    load(cluster)
    state = httpx.get(cluster.url("/dashboard/api/state")).json()
    (worker,) = state["workers"]
    assert worker["worker_id"] == "w0" and worker["num_total_blocks"] == 192
    assert sum(worker["history"]["prefill"]) > 0 and sum(worker["history"]["decode"]) > 0

    dom = chromium(tmp_path, cluster.url("/dashboard"), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-worker-id="w0"' in html, html[-3000:]
    assert 'class="wid">w0<' in html
    assert "<small> / 192</small>" in html  # the KV blocks tile is filled in
    assert "live ·" in html  # the poll succeeded
    assert "SmolLM2-135M-Instruct" in html

    shot = tmp_path / "dashboard.png"
    result = chromium(tmp_path, cluster.url("/dashboard"), f"--screenshot={shot}")
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    if os.environ.get("SPLITSERVE_UPDATE_DOCS"):
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(shot, ROOT / "docs" / "dashboard.png")
