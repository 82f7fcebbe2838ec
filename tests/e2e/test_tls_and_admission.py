"""TLS on the client API, the cluster's mutual TLS on worker links, and admission control
(queue bound, per-tenant rates, unknown tenants), with simulated workers."""

from __future__ import annotations

import ssl
import threading
import time

import grpc
import httpx
import pytest

from common.client import SplitserveClient
from tests.e2e.certs import CertAuthority
from tests.e2e.procs import Cluster, free_port

pytestmark = [pytest.mark.e2e]
SIM = ("--simulate", "--sim-step-base-ms", "5")


def wait_workers(client, n, timeout=60):
    deadline = time.monotonic() + timeout
    while len(client.server_info().workers) != n:
        assert time.monotonic() < deadline, "workers did not attach"
        time.sleep(0.05)


def test_tls_client_api_and_the_clusters_mutual_tls_on_worker_links(tmp_path, cluster_credentials):
    ca = CertAuthority(tmp_path)  # the client API's own certificate, of the operator's CA
    server_cert, server_key = ca.issue("localhost", server=True)
    rogue = cluster_credentials.parent / "rogue"
    c = Cluster(tmp_path)
    try:
        http_port = free_port()
        c.start_scheduler(
            "--http-port",
            str(http_port),
            "--tls-cert-file",
            server_cert,
            "--tls-key-file",
            server_key,
            "--credentials",
            str(cluster_credentials / "scheduler"),
        )
        good = c.start_worker("good", *SIM, "--credentials", str(cluster_credentials / "worker"))
        outsider = c.start_worker("outsider", *SIM, "--credentials", str(rogue / "worker"))
        plain = c.start_worker("plain", *SIM)  # no credentials: plaintext to loopback
        # a front-end's credentials are not a worker's: refused before the worker starts
        wrong_role = c.start_worker(
            "wrong-role", *SIM, "--credentials", str(cluster_credentials / "frontend")
        )
        with SplitserveClient(
            c.target, timeout=30, tls_ca_file=ca.cert_file, tls_server_name="localhost"
        ) as client:
            wait_workers(client, 1)
            time.sleep(1.5)  # give the refused workers time to (fail to) attach
            assert [w.worker_id for w in client.server_info().workers] == ["good"]
            result = client.generate(
                token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, temperature=0.0
            )
            assert len(result.token_ids) == 3
        assert good.alive() and outsider.alive() and plain.alive()  # they keep retrying
        assert wrong_role.popen.wait(30) == 2
        assert "a frontend's certificate; this process is a worker" in wrong_role.log()
        # the HTTP API is served over TLS with the client API's certificate
        response = httpx.get(
            f"https://127.0.0.1:{http_port}/v1/models",
            verify=ssl.create_default_context(cafile=ca.cert_file),
        )
        assert response.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=5)
        # a plaintext client cannot talk to the TLS port
        with SplitserveClient(c.target, timeout=5) as plain_client:
            with pytest.raises(grpc.RpcError) as err:
                plain_client.server_info()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop_all()


def test_queue_bound_refuses_at_once_with_resource_exhausted(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler(
            "--max-waiting-requests", "4", "--max-num-seqs", "2", "--worker-queue-depth", "1"
        )
        c.start_worker("w", "--simulate", "--sim-step-base-ms", "40")
        with SplitserveClient(c.target, timeout=60) as client:
            wait_workers(client, 1)
            outcomes: list[str] = []
            lock = threading.Lock()

            def one(i):
                try:
                    r = client.generate(
                        token_ids=[4, 5, i + 3], max_tokens=20, ignore_eos=True, temperature=0.0
                    )
                    outcome = r.finish_reason
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "waiting queue is full" in exc.details()
                    meta = dict(exc.trailing_metadata() or ())
                    assert float(meta["retry-after"]) > 0
                    outcome = "refused"
                with lock:
                    outcomes.append(outcome)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(outcomes) == 20
            assert outcomes.count("length") >= 4  # at least the queue bound's worth ran
            assert outcomes.count("refused") >= 1
            assert outcomes.count("length") + outcomes.count("refused") == 20
            info = client.server_info()
            assert info.num_requests_in_flight == 0
            assert all(w.num_free_blocks == w.num_blocks for w in info.workers)
    finally:
        c.stop_all()


def test_tenant_rate_limit_and_unknown_tenant(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.start_scheduler(
            "--tenant-rate-limit", "1", "--tenant-burst", "2", "--tenants", "alpha:3,beta:1"
        )
        c.start_worker("w", *SIM)
        with SplitserveClient(c.target, timeout=60) as client:
            wait_workers(client, 1)
            ok = [
                client.generate(token_ids=[9, 9], max_tokens=1, tenant="alpha") for _ in range(2)
            ]  # the burst
            assert all(r.finish_reason for r in ok)
            with pytest.raises(grpc.RpcError) as err:
                client.generate(token_ids=[9, 9], max_tokens=1, tenant="alpha")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rate limit" in err.value.details()
            # another tenant has its own bucket
            assert client.generate(token_ids=[9, 9], max_tokens=1, tenant="beta").finish_reason
            with pytest.raises(grpc.RpcError) as err:
                client.generate(token_ids=[9, 9], max_tokens=1, tenant="gamma")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown tenant" in err.value.details()
            time.sleep(1.1)  # the bucket refills
            assert client.generate(token_ids=[9, 9], max_tokens=1, tenant="alpha").finish_reason
    finally:
        c.stop_all()
