"""Router + two decode workers + one pool, all real processes on loopback (docs/architecture.md):
concurrency, resume after a worker dies, cancellation, bad requests, overload, metrics."""
import contextlib
import json
import os
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving import (BIN, TOKEN, Proc, ddctl, ddctl_json, make_certs, require_model, secret_file, start_worker,
                     wait_for, workers_up)
from conftest import CLUSTER_SECRET


def prompt(i):
    return f"Note {i}: " + "the river flows past the old mill and the miller counts sacks of grain. " * (2 + i % 5)


def generate(router, text, n, *extra):
    return ddctl_json("generate", "--server", router, "--prompt", text, "--max_new_tokens", str(n), "--ignore_eos",
                      *extra)


def worker_stats(addr, secret=None):
    r = ddctl("stats", "--worker", addr, *([f"--cluster_secret_file={secret}"] if secret else []))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def scrape(metrics_addr):
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as f:
        return f.read().decode()


def metric(text, name):
    """Sum of the samples of `name` (any labels, or the exact series) in a Prometheus text page;
    a series that is not there fails the test."""
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(name + " ") or line.startswith(name + "{")]
    assert found, f"{name} not in the metrics page"
    return sum(found)


def test_health_models_and_workers(cluster):
    router = cluster["router"].addr
    h = ddctl("health", "--server", router, "--json")
    assert h.returncode == 0, h.stderr
    assert json.loads(h.stdout)["workers_up"] == 2
    w = json.loads(ddctl("workers", "--server", router, "--json").stdout)["workers"]
    assert sorted(x["worker_id"] for x in w) == ["w1", "w2"]
    assert all(x["mode"] == "dualdecoder" and x["kv_store"].startswith("shm://") for x in w)


def test_usage_reports_kv_traffic_and_memory_against_full(cluster):
    """The last message's usage says what the request moved and what its KV costs on the device,
    next to full attention (what scripts/demo prints)."""
    out = generate(cluster["router"].addr, prompt(3) * 6, 24)
    u = out["usage"]
    assert u["mode"] == "dualdecoder" and u["kv_dtype"] == "f32"
    block = 2 * 8 * 64 * 4  # one [K|V] chunk of one KV head (SmolLM2) or a multiple of it (Gemma: 256)
    for key in ("kv_prefetch_bytes", "kv_urgent_bytes", "kv_wasted_bytes"):
        assert int(u[key]) >= 0 and int(u[key]) % block == 0, (key, u)
    assert int(u["kv_prefetch_bytes"]) > 0, u  # beyond the budget: chunks were prefetched
    assert int(u["kv_wasted_bytes"]) <= int(u["kv_prefetch_bytes"]), u
    assert 0 < int(u["kv_device_bytes"]) < int(u["full_kv_device_bytes"]), u


def test_sixteen_concurrent_streams_match_one_at_a_time(cluster):
    router = cluster["router"].addr
    n = 8
    alone = [generate(router, prompt(i), n) for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as ex:
        together = list(ex.map(lambda i: generate(router, prompt(i), n), range(16)))
    for i in range(16):
        assert together[i]["tokens"] == alone[i]["tokens"], f"request {i}"
        assert together[i]["text"] == alone[i]["text"]
        assert len(together[i]["tokens"]) == n
    served_by = {r["usage"]["worker_id"] for r in together}
    assert served_by == {"w1", "w2"}, "placement spreads the load over both workers"
    page = scrape(cluster["router"].metrics)
    assert metric(page, 'dd_requests_total{code="OK"}') >= 32
    assert metric(page, "dd_worker_up") == 2
    wpage = scrape(cluster["workers"]["w1"].metrics)
    for name in ("dd_decode_tokens_total", "dd_step_seconds_count", "dd_ttft_seconds_count", "dd_batch_size",
                 "dd_device_memory_bytes", "dd_prefetch_hit_ratio", "dd_kv_bytes_total", "dd_spec_resyncs_total", "dd_requests_rebuilt_total"):
        assert name in wpage, name
    assert metric(wpage, "dd_decode_tokens_total") > 0
    assert metric(wpage, 'dd_kv_dtype{dtype="f32"}') == 1 and metric(wpage, "dd_kv_saturated_values_total") == 0
    # dualdecoder keeps chunks resident across steps (docs/decisions/0012-resident-set.md): some selected chunks were reused.
    chunks = {}
    for line in wpage.splitlines():
        if line.startswith("dd_kv_chunks_total{"):
            event = line.split('event="', 1)[1].split('"', 1)[0]
            chunks[event] = chunks.get(event, 0) + float(line.rsplit(" ", 1)[1])
    assert chunks.get("selected", 0) > 0, chunks
    assert 0 < chunks.get("reused", 0) <= chunks["selected"], chunks


@pytest.mark.parametrize("args,field", [
    (["--prompt", ""], "prompt"),
    (["--prompt", "hi", "--max_new_tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--max_new_tokens", "5000"], "max_new_tokens"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--model_name", "no-such-model"], "model"),
    (["--tokens", ",".join(["2"] * 33000)], "context"),
])
def test_bad_requests_are_invalid_argument(cluster, args, field):
    r = ddctl("generate", "--server", cluster["router"].addr, *args)
    assert r.returncode != 0
    assert "INVALID_ARGUMENT" in r.stderr and field in r.stderr, r.stderr


def stream_until_tokens(router, text, n, min_tokens, *extra):
    """Starts a streaming ddctl and returns it once `min_tokens` tokens have arrived."""
    p = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", router, "--prompt", text, "--max_new_tokens",
                          str(n), "--ignore_eos", "--events", *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    got = 0
    while got < min_tokens:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        got += len(json.loads(line).get("token_ids", []))
    return p


def idle(cluster):
    stats = [worker_stats(w.addr, cluster["secret"]) for w in cluster["workers"].values() if w.proc.poll() is None]
    if all(s["load"]["active_requests"] == 0 and s["reserved_device_bytes"] == "0" for s in stats):
        return stats
    return None


def test_cancel_frees_worker_state(cluster):
    router = cluster["router"].addr
    before = sum(int(worker_stats(w.addr, cluster["secret"])["requests_cancelled"]) for w in cluster["workers"].values())
    p = stream_until_tokens(router, prompt(3), 2000, 2)
    p.kill()  # the client goes away mid-stream
    p.wait()
    stats = wait_for("worker state freed", lambda: idle(cluster))
    assert sum(int(s["requests_cancelled"]) for s in stats) == before + 1
    assert all(s["kv_bytes"] == "0" for s in stats)
    # Its blocks in the pool are released too: nothing is leased any more (committed prompt
    # prefixes stay, unleased, as a cache the pool evicts when it needs the room).
    pool = scrape(cluster["pool"].metrics)
    assert metric(pool, 'dd_pool_bytes{tenant="serve",state="leased"}') == 0, pool


def test_deadline_ends_request_and_frees_state(cluster):
    r = ddctl("generate", "--server", cluster["router"].addr, "--prompt", prompt(1), "--max_new_tokens", "3000",
              "--ignore_eos", "--deadline_ms", "1500")
    assert r.returncode != 0 and "DEADLINE_EXCEEDED" in r.stderr, r.stderr
    wait_for("worker state freed", lambda: idle(cluster))


def test_no_workers_then_overload(tmp_path):
    router = Proc("lonely-router", ["dd-router", "--heartbeat_timeout_ms=1500"], tmp_path)
    worker = None
    try:
        r = ddctl("generate", "--server", router.addr, "--prompt", "hello")
        assert r.returncode != 0 and "UNAVAILABLE" in r.stderr, r.stderr
        assert ddctl("health", "--server", router.addr).returncode != 0
        worker = start_worker("solo", router.addr, tmp_path, "--max_batch=1", "--max_waiting=0",
                              "--device_memory=380MiB")
        wait_for("worker up", lambda: workers_up(router.addr) == 1)
        # A request that cannot fit the worker's device memory even alone is refused with the numbers.
        r = ddctl("generate", "--server", router.addr, "--prompt", "lorem ipsum dolor " * 4000)
        assert r.returncode != 0 and "RESOURCE_EXHAUSTED" in r.stderr and "device_memory" in r.stderr, r.stderr
        busy = stream_until_tokens(router.addr, prompt(2), 2000, 1)
        r = ddctl("generate", "--server", router.addr, "--prompt", "hello")
        assert r.returncode != 0 and "RESOURCE_EXHAUSTED" in r.stderr, r.stderr
        busy.kill()
        busy.wait()
    finally:
        if worker:
            worker.stop()
        router.stop()


def test_stop_ids_and_stop_strings_end_the_stream(cluster):
    router = cluster["router"].addr
    # A prompt whose greedy continuation brings a new token id after the second (a small model
    # may repeat one token: then the stop id would end the stream earlier than at k).
    for n in range(5, 15):
        ref = generate(router, prompt(n), 12)
        toks = ref["tokens"]
        k = next((i for i in range(2, len(toks)) if toks[i] not in toks[:i]), None)  # first id not seen before
        if k is not None:
            break
    assert k is not None, "no prompt's continuation had a new token id after the second"
    by_id = generate(router, prompt(n), 12, "--stop_ids", str(toks[k]))
    assert by_id["tokens"] == toks[:k] and by_id["stop_reason"] == "stop_id", by_id
    half = len(ref["text"]) // 2
    cut = next(ref["text"][j:j + 6] for j in range(half, len(ref["text"]) - 5)
               if "," not in ref["text"][j:j + 6] and ref["text"][j:j + 6].strip())  # --stop splits on commas
    by_text = generate(router, prompt(n), 12, "--stop", cut)
    assert by_text["stop_reason"] == "stop_string", by_text
    assert by_text["text"] == ref["text"][:ref["text"].index(cut)]


def test_internal_calls_need_the_cluster_secret(cluster):
    """Security model (docs/decisions/0026): without the cluster secret nobody can call a worker (stats, submit,
    cancel) or register a worker with the router, not even under a real worker's id."""
    router, w1 = cluster["router"].addr, cluster["workers"]["w1"]
    wrong = secret_file(cluster["logs"], "not-the-cluster-secret-0123456789abcdef")
    for extra in ([], [f"--cluster_secret_file={wrong}"]):
        r = ddctl("stats", "--worker", w1.addr, *extra)
        assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr, r.stderr
    assert worker_stats(w1.addr, cluster["secret"])["worker_id"] == "w1"
    # An impostor claiming w1's id with a wrong secret is refused; w1 keeps its place.
    (cluster["logs"] / "impostor").mkdir(exist_ok=True)
    impostor = start_worker("w1", router, cluster["logs"] / "impostor", f"--cluster_secret_file={wrong}")
    try:
        wait_for("the router's refusal", lambda: "UNAUTHENTICATED" in impostor.log.read_text(), timeout=30)
        listed = {w["worker_id"]: w for w in ddctl_json("workers", "--server", router)["workers"]}
        assert set(listed) == {"w1", "w2"} and listed["w1"]["address"] == w1.addr, listed
    finally:
        impostor.stop()
    # The secret file is checked: too short or readable by others is refused at start.
    short = secret_file(cluster["logs"], "short")
    loose = secret_file(cluster["logs"], CLUSTER_SECRET + "-loose")
    loose.chmod(0o644)
    for path, why in ((short, "at least 32"), (loose, "group or others")):
        r = subprocess.run([str(BIN / "dd-router"), f"--cluster_secret_file={path}"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_embedded_server_keeps_internal_services_off_the_public_port(tmp_path):
    """ddctl serve: the public port has the API only; the worker and registry services are on the
    internal port and answer only with the cluster secret (a random one unless configured)."""
    model = require_model()
    secret = secret_file(tmp_path, CLUSTER_SECRET)
    for configured in (False, True):
        extra = [f"--cluster_secret_file={secret}"] if configured else []
        serve = Proc(f"serve-{configured}", ["ddctl", "serve", f"--model={model}", "--threads=1", *extra], tmp_path)
        try:
            public = serve.addr
            internal = serve.internal
            assert internal and internal != public
            r = ddctl("stats", "--worker", public)
            assert r.returncode != 0 and "UNIMPLEMENTED" in r.stderr, r.stderr
            r = ddctl("stats", "--worker", internal)
            assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr, r.stderr
            if configured:
                assert worker_stats(internal, secret)["worker_id"] == "embedded"
            out = ddctl_json("generate", "--server", public, "--prompt", "Hello", "--max_new_tokens", "2",
                             "--ignore_eos")
            assert len(out["tokens"]) == 2, out
        finally:
            serve.stop()


def test_router_and_worker_over_mutual_tls(tmp_path):
    """Security model (docs/decisions/0026): --tls_cert/--tls_key/--tls_ca put the router, the worker and ddctl on
    mutual TLS: a client without the CA, or without a certificate, is refused; so is a worker."""
    certs = make_certs(tmp_path)
    tls = [f"--tls_ca={certs['ca']}", f"--tls_cert={certs['cert']}", f"--tls_key={certs['key']}"]
    router = Proc("tls-router", ["dd-router", "--heartbeat_timeout_ms=1500", *tls], tmp_path)
    workers = []
    try:
        workers.append(start_worker("tls-w", router.addr, tmp_path, *tls))
        workers.append(start_worker("plain-w", router.addr, tmp_path))  # no TLS: cannot register

        def up():
            r = ddctl("workers", "--server", router.addr, "--json", *tls)
            return r.returncode == 0 and [w["worker_id"] for w in json.loads(r.stdout)["workers"] if w["up"]]
        assert wait_for("the TLS worker up", up) == ["tls-w"]
        out = ddctl_json("generate", "--server", router.addr, "--prompt", "Hello", "--max_new_tokens", "2",
                         "--ignore_eos", *tls)
        assert len(out["tokens"]) == 2 and out["usage"]["worker_id"] == "tls-w", out
        for extra in ([], [f"--tls_ca={certs['ca']}"]):  # plaintext; TLS without a client certificate
            r = ddctl("generate", "--server", router.addr, "--prompt", "Hello", "--max_new_tokens", "2", *extra,
                      "--deadline_ms=5000")
            assert r.returncode != 0 and "UNAVAILABLE" in r.stderr, r.stderr
        assert [w["worker_id"] for w in ddctl_json("workers", "--server", router.addr, *tls)["workers"]] == ["tls-w"]
        r = ddctl("stats", "--server", router.addr, "--tls_cert", str(certs["cert"]))  # cert without key
        assert r.returncode == 2 and "--tls_cert and --tls_key go together" in r.stderr, r.stderr
    finally:
        for w in workers:
            w.stop()
        router.stop()


def test_api_keys_and_the_operator_key(tmp_path):
    """Security model (docs/decisions/0026): with --api_keys_file, Generate and ListModels need a tenant key; the
    operator calls (ListWorkers, Stats) need --operator_key_file's key; Health stays open."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "team-a", "key": "a" * 40}, {"tenant": "team-b", "key": "b" * 40}]))
    keys.chmod(0o600)
    op = secret_file(tmp_path, "o" * 40)
    tenant_key, op_key = secret_file(tmp_path, "a" * 40), op
    router = Proc("keyed-router", ["dd-router", "--heartbeat_timeout_ms=1500", f"--api_keys_file={keys}",
                                   f"--operator_key_file={op}"], tmp_path)
    worker = None
    try:
        worker = start_worker("keyed-w", router.addr, tmp_path)
        wait_for("worker up", lambda: ddctl("health", "--server", router.addr).returncode == 0)  # no key needed
        gen = ["generate", "--server", router.addr, "--prompt", "Hello", "--max_new_tokens", "2", "--ignore_eos"]
        r = ddctl(*gen)
        assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr and "missing API key" in r.stderr, r.stderr
        wrong = secret_file(tmp_path, "w" * 40)
        r = ddctl(*gen, f"--api_key_file={wrong}")
        assert r.returncode != 0 and "unknown API key" in r.stderr, r.stderr
        out = ddctl_json(*gen, f"--api_key_file={tenant_key}")
        assert len(out["tokens"]) == 2, out
        # Where a request was placed is the operator's to know, not a tenant's.
        assert out["usage"].get("worker_id", "") == "", out
        assert ddctl_json(*gen, f"--api_key_file={op_key}")["usage"]["worker_id"] == "keyed-w"
        r = ddctl("workers", "--server", router.addr, f"--api_key_file={tenant_key}")
        assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr, r.stderr
        r = ddctl("stats", "--server", router.addr)
        assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr, r.stderr
        listed = ddctl_json("workers", "--server", router.addr, f"--api_key_file={op_key}")
        assert [w["worker_id"] for w in listed["workers"]] == ["keyed-w"], listed
    finally:
        if worker:
            worker.stop()
        router.stop()
    keys.chmod(0o644)
    r = subprocess.run([str(BIN / "dd-router"), f"--api_keys_file={keys}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "group or others" in r.stderr, r.stderr


def test_tenants_cannot_cancel_or_squat_each_others_request_ids(tmp_path):
    """A client's request_id names the request to that client only. Tenant B sending tenant A's
    id with a slow-to-tokenize prompt and a 100 ms deadline (its call ends, so the router cancels
    it on the worker) leaves A's request running to its end; B holding an id first does not make
    A's request with that id ALREADY_EXISTS. Each gets its own id back in its usage."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "team-a", "key": "a" * 40}, {"tenant": "team-b", "key": "b" * 40}]))
    keys.chmod(0o600)
    a_key, b_key = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    router = Proc("tenants-router", ["dd-router", "--heartbeat_timeout_ms=1500", f"--api_keys_file={keys}"], tmp_path)
    worker = None
    try:
        worker = start_worker("tenants-w", router.addr, tmp_path)
        wait_for("worker up", lambda: ddctl("health", "--server", router.addr).returncode == 0)
        slow = tmp_path / "slow.txt"
        slow.write_text("the miller counts sacks of grain and the river flows " * 30000)  # ~0.5 s to tokenize
        # Cancel: A runs with id "shared"; B's call with the same id ends at its deadline.
        a = stream_until_tokens(router.addr, prompt(2), 48, 2, "--request_id=shared", f"--api_key_file={a_key}")
        r = ddctl("generate", "--server", router.addr, "--prompt_file", str(slow), "--max_new_tokens", "4",
                  "--request_id=shared", "--deadline_ms=100", f"--api_key_file={b_key}")
        assert r.returncode != 0 and "DEADLINE_EXCEEDED" in r.stderr, r.stderr
        out, err = a.communicate(timeout=300)
        assert a.returncode == 0, err
        done = json.loads(out.strip().splitlines()[-1])
        assert done["generated_tokens"] == 48 and done["stop_reason"] == "max_tokens", done
        assert done["usage"]["request_id"] == "shared", done
        # Squat: B holds "held" while A sends a request with the same id.
        b = stream_until_tokens(router.addr, prompt(3), 400, 2, "--request_id=held", f"--api_key_file={b_key}")
        mine = ddctl_json("generate", "--server", router.addr, "--prompt", "Hello", "--max_new_tokens", "2",
                          "--ignore_eos", "--request_id=held", f"--api_key_file={a_key}")
        assert len(mine["tokens"]) == 2 and mine["usage"]["request_id"] == "held", mine
        b.kill()
        b.wait()
    finally:
        if worker:
            worker.stop()
        router.stop()


@contextlib.contextmanager
def keyed_cluster(tmp_path, name, keys, quota, *worker_args):
    """A pool (one tenant of `quota`), a router with the API `keys` and one worker on the pool;
    yields the router's address."""
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(keys))
    keys_file.chmod(0o600)
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "serve", "token": TOKEN, "quota": quota}]))
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    procs = []
    try:
        pool = Proc(f"{name}-pool", ["dd-kv-pool", f"--tenants={cfg}"], tmp_path)
        procs.append(pool)
        router = Proc(f"{name}-router", ["dd-router", "--heartbeat_timeout_ms=1500", f"--api_keys_file={keys_file}"],
                      tmp_path)
        procs.append(router)
        procs.append(start_worker(f"{name}-w", router.addr, tmp_path, f"--kv_store=shm://{pool.addr}", *worker_args,
                                  env=dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)))
        wait_for("worker up", lambda: ddctl("health", "--server", router.addr).returncode == 0)
        yield router.addr
    finally:
        for p in reversed(procs):
            p.stop()


def test_prefix_reuse_is_scoped_to_the_api_tenant(tmp_path):
    """Prefix reuse through a real pool: tenant B sending the text tenant A sent restores none of
    A's blocks (no prefill skipped: no oracle for "did someone send this"), while A's own repeat
    still restores its prefix."""
    keys = [{"tenant": "team-a", "key": "a" * 40}, {"tenant": "team-b", "key": "b" * 40}]
    a_key, b_key = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    with keyed_cluster(tmp_path, "prefix", keys, "1GiB", "--mode=dualdecoder", "--budget=256",
                       "--prefix_block=64") as router:
        text = prompt(4) * 3

        def reused(key):
            out = ddctl_json("generate", "--server", router, "--prompt", text, "--max_new_tokens", "2",
                             "--ignore_eos", f"--api_key_file={key}")
            return int(out["usage"].get("prefix_reused_tokens", 0))

        assert reused(a_key) == 0
        assert reused(b_key) == 0  # the same text from another tenant: nothing of A's
        assert reused(a_key) >= 64  # A's own repeat


def test_pool_killed_mid_stream_loses_no_request(tmp_path):
    """Pool loss (docs/decisions/0024): the KV pool is SIGKILLed while three greedy streams decode from it and a new pool
    starts at the same address. The worker rebuilds each request's KV (prompt + tokens already
    streamed) and every stream ends with exactly the tokens of an uninterrupted run."""
    from serving import TOKEN
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "serve", "token": TOKEN, "quota": "1GiB"}]))
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    procs = []
    try:
        pool = Proc("pool", ["dd-kv-pool", f"--tenants={cfg}", "--lease_ttl_ms=3000"], tmp_path)
        procs.append(pool)
        router = Proc("rb-router", ["dd-router", "--heartbeat_timeout_ms=1500"], tmp_path)
        procs.append(router)
        env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
        worker = start_worker("rb-w", router.addr, tmp_path, "--mode=dualdecoder", "--budget=256",
                              f"--kv_store=shm://{pool.addr}", "--max_batch=4", "--pool_recovery_ms=60000", env=env)
        procs.append(worker)
        wait_for("worker up", lambda: workers_up(router.addr) == 1)
        n = 96  # long enough that the lost pool is noticed (lease renewal, 1 s) mid-stream
        want = [generate(router.addr, prompt(20 + i), n) for i in range(3)]
        streams = [stream_until_tokens(router.addr, prompt(20 + i), n, 0) for i in range(3)]
        before = int(worker_stats(worker.addr)["decode_tokens_total"])
        wait_for("streams decoding", lambda: int(worker_stats(worker.addr)["decode_tokens_total"]) > before + 3)
        pool.kill()
        pool2 = Proc("pool2", ["dd-kv-pool", f"--tenants={cfg}", f"--listen={pool.addr}", "--lease_ttl_ms=3000"],
                     tmp_path)
        procs.append(pool2)
        for i, p in enumerate(streams):
            lines = [json.loads(line) for line in p.stdout]
            assert p.wait(timeout=300) == 0, p.stderr.read()
            tokens = [t for m in lines[:-1] for t in m.get("token_ids", [])]
            assert tokens == want[i]["tokens"], f"stream {i}"
            assert lines[-1]["text"] == want[i]["text"]
            assert lines[-1]["usage"]["resumes"] == 0, "rebuilt on the same worker, not resumed elsewhere"
        stats = worker_stats(worker.addr)
        assert int(stats["requests_rebuilt"]) >= 1 and int(stats["requests_failed"]) == 0, stats
    finally:
        for p in reversed(procs):
            p.stop()


def test_worker_killed_mid_stream_resumes_elsewhere(cluster):
    """Runs last in the module: it kills a worker. Every stream completes with exactly the
    tokens of an uninterrupted run: none repeated, none missing."""
    router = cluster["router"].addr
    n = 40
    want = [generate(router, prompt(10 + i), n) for i in range(4)]
    procs = []
    for i in range(4):
        procs.append(stream_until_tokens(router, prompt(10 + i), n, 0))

    def collect(p, out):
        out["lines"] = [json.loads(line) for line in p.stdout]
        out["rc"] = p.wait()
        out["err"] = p.stderr.read()

    results = [{} for _ in procs]
    threads = [threading.Thread(target=collect, args=(p, r)) for p, r in zip(procs, results)]
    for t in threads:
        t.start()
    # Kill the worker once it is streaming.
    victim = cluster["workers"]["w1"]
    wait_for("w1 decoding", lambda: int(worker_stats(victim.addr, cluster["secret"])["decode_tokens_total"]) > 0 and
             worker_stats(victim.addr, cluster["secret"])["load"]["active_requests"] > 0)
    victim.kill()
    for t in threads:
        t.join(timeout=300)
    resumed = 0
    for i, r in enumerate(results):
        assert r["rc"] == 0, r["err"]
        summary = r["lines"][-1]
        tokens = [t for m in r["lines"][:-1] for t in m.get("token_ids", [])]
        indices = [int(m.get("first_token_index", 0)) for m in r["lines"][:-1] if m.get("token_ids")]
        assert tokens == want[i]["tokens"], f"stream {i}"
        assert summary["text"] == want[i]["text"]
        assert indices == sorted(indices) and len(set(indices)) == len(indices)
        resumed += summary["usage"]["resumes"]
    assert resumed >= 1, "at least one stream was on the killed worker"
    stats = json.loads(ddctl("stats", "--server", router).stdout)
    assert int(stats["resumes"]) >= 1



def test_a_tenant_at_its_inflight_limit_is_refused_and_the_others_are_not(tmp_path):
    """Per-tenant limits: team-a may have one request in flight (its key's max_inflight); its
    second gets RESOURCE_EXHAUSTED naming the tenant and the limit while team-b is served, and
    team-a is served again once its first request ends."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "team-a", "key": "a" * 40, "max_inflight": 1},
                                {"tenant": "team-b", "key": "b" * 40}]))
    keys.chmod(0o600)
    a_key, b_key = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    serve = Proc("limits-serve", ["ddctl", "serve", "--model=smollm2", f"--api_keys_file={keys}"], tmp_path)
    try:
        a = stream_until_tokens(serve.addr, prompt(5), 400, 2, f"--api_key_file={a_key}")
        r = ddctl("generate", "--server", serve.addr, "--prompt", "Hello", "--max_new_tokens", "2",
                  f"--api_key_file={a_key}")
        assert r.returncode != 0 and "RESOURCE_EXHAUSTED" in r.stderr and "tenant 'team-a'" in r.stderr, r.stderr
        b = ddctl_json("generate", "--server", serve.addr, "--prompt", "Hello", "--max_new_tokens", "2",
                       "--ignore_eos", f"--api_key_file={b_key}")
        assert len(b["tokens"]) == 2, b
        a.kill()
        a.wait()
        again = wait_for("team-a admitted again", lambda: ddctl(
            "generate", "--server", serve.addr, "--prompt", "Hello", "--max_new_tokens", "2",
            f"--api_key_file={a_key}").returncode == 0)
        assert again
    finally:
        serve.stop()


def test_tenants_that_opt_in_share_prefixes_and_the_others_do_not(tmp_path):
    """`shared_prefixes` in the keys file: two opted-in tenants reuse each other's prefix (a common
    system prompt); a tenant that did not opt in reuses none of theirs, and they none of its."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "private", "key": "a" * 40},
                                {"tenant": "shared-1", "key": "b" * 40, "shared_prefixes": True},
                                {"tenant": "shared-2", "key": "c" * 40, "shared_prefixes": True}]))
    keys.chmod(0o600)
    key = {n: secret_file(tmp_path, c * 40) for n, c in (("private", "a"), ("s1", "b"), ("s2", "c"))}
    serve = Proc("shared-serve", ["ddctl", "serve", "--model=smollm2", f"--api_keys_file={keys}"], tmp_path)

    def reused(who, text):
        out = ddctl_json("generate", "--server", serve.addr, "--prompt", text, "--max_new_tokens", "1",
                         f"--api_key_file={key[who]}")
        return int(out["usage"].get("prefix_reused_tokens", 0))

    try:
        system = prompt(6) * 3
        assert reused("s1", system) == 0
        assert reused("s2", system) >= 64  # opted in: s1's prefix
        assert reused("private", system) == 0  # not opted in: nothing of theirs
        mine = prompt(7) * 3
        assert reused("private", mine) == 0
        assert reused("s1", mine) == 0  # and they nothing of its
    finally:
        serve.stop()


def test_a_tenant_cannot_fill_the_pool_quota_the_others_share(tmp_path):
    """Per-tenant pool bytes: behind one worker on a 256 MiB pool quota, team-a may hold at most
    half of it (--tenant_max_pool_bytes=auto). Its second long request is refused naming the
    limit while team-b's is admitted beside its first, and team-a is admitted again once its
    first request ends."""
    keys = [{"tenant": "team-a", "key": "a" * 40, "max_inflight": 8},
            {"tenant": "team-b", "key": "b" * 40, "max_inflight": 8}]
    a_key, b_key = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    with keyed_cluster(tmp_path, "quota", keys, "256MiB", "--mode=sparse", "--budget=256",
                       "--prefix_block=0") as router:
        # A sequence's first pool extent holds 2048 tokens: 72 MiB of Gemma 3 270M's blocks. Two
        # are past team-a's 128 MiB; before the limit, three of them filled the quota.
        n = 600
        a = stream_until_tokens(router, prompt(1), n, 1, f"--api_key_file={a_key}")
        r = ddctl("generate", "--server", router, "--prompt", prompt(2), "--max_new_tokens", str(n),
                  f"--api_key_file={a_key}")
        assert r.returncode != 0 and "RESOURCE_EXHAUSTED" in r.stderr, r.stderr
        assert "tenant team-a" in r.stderr and "--tenant_max_pool_bytes" in r.stderr, r.stderr
        b = stream_until_tokens(router, prompt(2), n, 1, f"--api_key_file={b_key}")
        a.kill()
        a.wait()

        def admitted():  # it runs until its 1 s deadline: admitted, not refused
            r = ddctl("generate", "--server", router, "--prompt", prompt(2), "--max_new_tokens", str(n),
                      "--deadline_ms=1000", f"--api_key_file={a_key}")
            return "RESOURCE_EXHAUSTED" not in r.stderr and (r.returncode == 0 or "DEADLINE_EXCEEDED" in r.stderr)

        assert wait_for("team-a admitted again", admitted)
        b.kill()
        b.wait()
