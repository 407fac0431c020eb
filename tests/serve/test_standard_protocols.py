"""gRPC's standard protocols on every server (docs/decisions/0029-operations-surface.md):
grpc.health.v1 (what Kubernetes' gRPC probes call), server reflection, and a worker's graceful drain
on SIGTERM. Real processes on loopback, checked with the standard Python clients
(grpcio-health-checking, grpcio-reflection)."""
import json
import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving import Proc, ddctl, ddctl_json, start_worker, wait_for, workers_up

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(addr, service=""):
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def services(addr):
    with grpc.insecure_channel(addr) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        return {s.name for r in replies for s in r.list_services_response.service}


def test_every_server_speaks_health_and_reflection(cluster, tmp_path):
    standard = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    expected = {
        cluster["pool"].addr: {"dd.kvpool.v1.KvPool"},
        cluster["router"].addr: {"dd.v1.DualDecoder", "dd.worker.v1.Registry"},
        cluster["workers"]["w1"].addr: {"dd.worker.v1.Worker"},
    }
    for addr, names in expected.items():
        assert health(addr) == SERVING, addr
        for name in names:
            assert health(addr, name) == SERVING, (addr, name)
        assert services(addr) >= names | standard, addr
        r = ddctl("grpc-health", "--server", addr)
        assert r.returncode == 0 and r.stdout.strip() == "SERVING", r.stdout + r.stderr
    # A service the server does not have is an error, not a false SERVING.
    with pytest.raises(grpc.RpcError) as e:
        health(cluster["router"].addr, "dd.v1.NoSuchService")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    r = ddctl("grpc-health", "--server", cluster["router"].addr, "--service", "dd.v1.NoSuchService")
    assert r.returncode != 0


def test_worker_drains_on_sigterm(tmp_path):
    """SIGTERM: the worker turns NOT_SERVING, the router sends it nothing new, the request it is
    running finishes with every token, and then it exits cleanly."""
    router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500"], tmp_path)
    worker = None
    try:
        worker = start_worker("drainer", router.addr, tmp_path, "--mode=sparse", "--budget=256")
        wait_for("worker up", lambda: workers_up(router.addr) == 1)
        n = 48
        result = {}

        def long_request():
            result["r"] = ddctl("generate", "--server", router.addr, "--prompt", "Tell a long story about a lighthouse.",
                                "--max_new_tokens", str(n), "--ignore_eos", "--json", "--events")

        t = threading.Thread(target=long_request)
        t.start()

        def running():
            s = ddctl("stats", "--worker", worker.addr)
            return s.returncode == 0 and json.loads(s.stdout)["load"].get("active_requests", 0) >= 1

        wait_for("the request to start", running)
        worker.proc.send_signal(signal.SIGTERM)
        wait_for("NOT_SERVING", lambda: health(worker.addr) == NOT_SERVING, timeout=30)
        # New work is refused while it drains, with a retryable code naming the reason.
        refused = ddctl("generate", "--server", router.addr, "--prompt", "hi", "--max_new_tokens", "2")
        assert refused.returncode != 0 and "draining" in refused.stderr, refused.stderr
        t.join(timeout=300)
        assert not t.is_alive()
        r = result["r"]
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(summary["tokens"]) == n, summary
        assert worker.proc.wait(timeout=60) == 0
        assert "drained" in worker.log.read_text()
    finally:
        if worker is not None:
            worker.stop()
        router.stop()
