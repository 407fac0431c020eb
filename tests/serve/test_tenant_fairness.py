"""Tenant fairness with real processes (docs/operations.md, "Security model as built"): while
tenant B floods the server with long prompts, tenant A's requests are all served, and A's time
to first token stays within twice its idle one. Two setups: `ddctl serve` with API keys (KV in
process), and a keyed router with a dualdecoder worker whose KV is in a `dd-kv-pool`.
Before, B's flood filled the worker (A refused 20 of 20), and with room A's prompt waited for
B's prompts to be read."""
import http.client
import json
import os
import statistics
import threading
import time
import urllib.request

import pytest

import models
from serving import TOKEN, Proc, require_model, secret_file, start_worker, wait_for

KEY_A, KEY_B = "tenant-a-key-" + "a" * 30, "tenant-b-key-" + "b" * 30


def metric(metrics_addr, name):
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def keys_file(d):
    keys = d / "keys.json"
    keys.write_text(json.dumps([{"tenant": "a", "key": KEY_A}, {"tenant": "b", "key": KEY_B}]))
    keys.chmod(0o600)
    return keys


@pytest.fixture(scope="module", params=["serve", "pool"])
def setup(request, tmp_path_factory):
    require_model()
    d = tmp_path_factory.mktemp(f"fair-{request.param}")
    smollm2 = str(models.model_path("smollm2"))
    procs = []
    try:
        if request.param == "serve":
            p = Proc("serve", ["ddctl", "serve", f"--model={smollm2}", "--http_listen=127.0.0.1:0",
                               f"--api_keys_file={keys_file(d)}", "--threads=2"], d)
            procs.append(p)
            yield {"http": p.http, "metrics": p.metrics}
        else:
            cfg = d / "tenants.json"
            cfg.write_text(json.dumps([{"name": "fair", "token": TOKEN, "quota": "4GiB"}]))
            cfg.chmod(0o600)
            secret = secret_file(d, "fairness-cluster-secret-0123456789abcdef")
            procs.append(Proc("pool", ["dd-kv-pool", f"--tenants={cfg}"], d))
            router = Proc("router", ["dd-router", "--http_listen=127.0.0.1:0", f"--api_keys_file={keys_file(d)}",
                                     f"--cluster_secret_file={secret}", "--heartbeat_timeout_ms=1500"], d)
            procs.append(router)
            worker = start_worker("w", router.addr, d, f"--model={smollm2}", "--threads=2", "--mode=dualdecoder",
                                  f"--kv_store=shm://{procs[0].addr}", f"--cluster_secret_file={secret}",
                                  env=dict(os.environ, DD_KV_POOL_TOKEN=TOKEN))
            procs.append(worker)
            wait_for("the worker registered", lambda: time_to_first_token(router.http, KEY_A, "Hello.") is not None)
            yield {"http": router.http, "metrics": worker.metrics}
    finally:
        for p in reversed(procs):
            p.stop()


def time_to_first_token(addr, key, prompt, max_tokens=1, hold=None):
    """Streams a completion; returns seconds to the first content chunk (None unless 200). With
    `hold`, the open connection is appended to it (the caller closes it to cancel)."""
    host, port = addr.rsplit(":", 1)
    t0 = time.monotonic()
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    if hold is not None:
        hold.append(c)
    try:
        c.request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}",
                                                      "Content-Type": "application/json"},
                  body=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}))
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return None
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - t0
                if hold is None:
                    break
        return first
    except OSError:
        return None  # closed by the test (a cancelled flood request)
    finally:
        if hold is None:
            c.close()


def a_prompt(i):  # ~1000 tokens, distinct from the first block on (no prefix reuse)
    return f"Request {i} from A. " + " ".join(f"note {j} says the sky is blue;" for j in range(100))


def b_prompt(i):  # ~1600 tokens
    return f"Flood {i} from B. " + " ".join(f"item {j} of the flood is red;" for j in range(200))


def test_a_tenant_is_served_promptly_while_another_floods(setup):
    idle = [time_to_first_token(setup["http"], KEY_A, a_prompt(i)) for i in range(5)]
    assert all(t is not None for t in idle), idle
    idle_ttft = statistics.median(idle)
    held, threads = [], []
    try:
        for i in range(32):
            t = threading.Thread(target=time_to_first_token, args=(setup["http"], KEY_B, b_prompt(i), 16, held))
            t.start()
            threads.append(t)
        # B holds its share of the worker before A comes back.
        wait_for("B's flood in the batch", lambda: metric(setup["metrics"], "dd_batch_size") >= 8)
        under = [time_to_first_token(setup["http"], KEY_A, a_prompt(100 + i)) for i in range(20)]
    finally:
        for c in held:
            if c.sock is not None:
                c.sock.shutdown(2)  # hanging up cancels B's requests
        for t in threads:
            t.join(timeout=60)
    served = [t for t in under if t is not None]
    print(f"idle TTFT median {idle_ttft:.3f} s; under the flood: served {len(served)} of 20, "
          f"median {statistics.median(served) if served else 0:.3f} s, worst {max(served, default=0):.3f} s")
    assert len(served) == 20, f"A was served {len(served)} of 20 times"
    worst = max(served)  # the p99 of 20
    assert worst <= 2 * idle_ttft, f"A's TTFT under B's flood: worst {worst:.2f} s against {idle_ttft:.2f} s idle"
