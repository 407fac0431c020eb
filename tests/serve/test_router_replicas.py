"""Router replicas on etcd (docs/decisions/0051-registry-on-etcd.md): a 3-member etcd, two
routers, two workers registered in etcd and a KV pool, all real processes. Streams survive the death of the
router relaying them (docs/decisions/0050-resumable-streams.md), a new router serves at once, and
the cluster keeps serving through the loss of an etcd member and of all of etcd."""
import json
import os
import subprocess
import time

from serving import (BIN, TOKEN, Etcd, Proc, ddctl, ddctl_json, make_certs, metric, require_model, secret_file, wait_for,
                     workers_up)

STREAMS = 16
TOKENS = 200


def prompt(i):
    return f"Letter {i}: " + "the river flows past the old mill and the miller counts sacks of grain. " * (1 + i % 3)


def router(name, etcd, log_dir):
    return Proc(name, ["dd-router", f"--registry={etcd.url}", "--heartbeat_timeout_ms=1500"], log_dir)


def worker(name, etcd, log_dir, *extra, env=None):
    return Proc(name, ["dd-decode-worker", f"--model={require_model()}", f"--registry={etcd.url}",
                       f"--worker_id={name}", "--threads=1", "--heartbeat_ms=200", "--max_batch=8", *extra], log_dir,
                env=env)


def start_stream(servers, i, request_id):
    return subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", servers, "--prompt", prompt(i),
                          "--max_new_tokens", str(TOKENS), "--ignore_eos", "--json", f"--request_id={request_id}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_streams_survive_a_router_kill_and_the_cluster_survives_etcd_losses(tmp_path):
    """The chaos run: a 3-member etcd, two routers, two dualdecoder workers on one pool."""
    etcd = Etcd(tmp_path, members=3)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([{"name": "serve", "token": TOKEN, "quota": "2GiB"}]))
    tenants.chmod(0o600)
    procs = []
    try:
        pool = Proc("pool", ["dd-kv-pool", f"--tenants={tenants}"], tmp_path)
        a, b = router("router-a", etcd, tmp_path), router("router-b", etcd, tmp_path)
        procs += [pool, a, b]
        # dualdecoder workers whose offloaded KV lives in the pool
        sparse = ("--mode=dualdecoder", "--budget=64", f"--kv_store=shm://{pool.addr}")
        env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
        procs += [worker(n, etcd, tmp_path, *sparse, env=env) for n in ("w1", "w2")]
        wait_for("both routers see both workers", lambda: workers_up(a.addr) == 2 and workers_up(b.addr) == 2)
        assert metric(a.metrics, "dd_router_replicas") == 2
        # Placement quality: the worker that served a long prompt through A publishes its prefix
        # key, and B, which never saw the prompt, sends it there too. A long stream through A
        # takes the first worker meanwhile; by load alone (both idle) B would pick that one.
        long_prompt = "Chapter two. " + prompt(8) * 8  # over 1 KiB: it has a prefix key
        hold = start_stream(a.addr, 0, "hold")
        wait_for("the hold stream placed", lambda: decoded(procs[2:]) > 0, timeout=120)
        placed = ddctl_json("generate", "--server", a.addr, "--prompt", long_prompt,
                            "--max_new_tokens", "4")["usage"]["worker_id"]
        held_on = finish(hold)[0]["usage"]["worker_id"]
        assert placed != held_on
        again = ddctl_json("generate", "--server", b.addr, "--prompt", long_prompt, "--max_new_tokens", "4")
        assert again["usage"]["worker_id"] == placed, (again["usage"], placed, held_on)
        # The undisturbed run.
        ref = [start_stream(b.addr, i, f"ref-{i}") for i in range(STREAMS)]
        want = [finish(p)[0]["tokens"] for p in ref]
        # The same 16 streams through router A, which is SIGKILLed once each has ~20 tokens: every
        # client reconnects to B with its id and the tokens it has.
        before = decoded(procs[2:])
        streams = [start_stream(f"{a.addr},{b.addr}", i, f"run-{i}") for i in range(STREAMS)]
        wait_for("~20 tokens of each stream", lambda: decoded(procs[2:]) - before >= 20 * STREAMS, timeout=300)
        a.kill()
        results = [finish(p) for p in streams]
        for i, (done, err) in enumerate(results):
            assert done["tokens"] == want[i], (i, err)
            assert 0 < int(err.split("reconnecting to ")[1].split(" after ")[1].split()[0]) < TOKENS, err
        assert sum("reconnecting" in err for _, err in results) == STREAMS
        assert metric(b.metrics, "dd_router_reconnects_total") == STREAMS
        # A new router serves within 2 s of its start (from its "listening" line; a ddctl call
        # itself takes ~0.1 s).
        c = router("router-c", etcd, tmp_path)
        t0 = time.monotonic()
        procs.append(c)
        wait_for("router C serves", lambda: ddctl("generate", "--server", c.addr, "--prompt", "Hi",
                                                  "--max_new_tokens", "2").returncode == 0, timeout=10)
        print(f"a new router served its first request {time.monotonic() - t0:.2f} s after it started listening")
        assert time.monotonic() - t0 < 2.0, time.monotonic() - t0
        # One etcd member down: registration and service go on.
        etcd.kill("etcd0")
        done = ddctl_json("generate", "--server", f"{c.addr},{b.addr}", "--prompt", prompt(1), "--max_new_tokens",
                          "16", "--ignore_eos")
        assert done["tokens"] == want[1][:16]
        w3 = worker("w3", etcd, tmp_path, *sparse, env=env)
        procs.append(w3)
        wait_for("w3 registered with one etcd member down", lambda: workers_up(c.addr) == 3, timeout=30)
        # All of etcd down: in-flight streams complete and new requests are served by the workers
        # last known; a worker that starts now registers once etcd is back.
        inflight = [start_stream(f"{b.addr},{c.addr}", i, f"dark-{i}") for i in range(4)]
        for n in etcd.names[1:]:
            etcd.kill(n)
        for i, p in enumerate(inflight):
            assert finish(p)[0]["tokens"] == want[i]
        done = ddctl_json("generate", "--server", b.addr, "--prompt", prompt(2), "--max_new_tokens", "8",
                          "--ignore_eos")
        assert done["tokens"] == want[2][:8]
        w4 = worker("w4", etcd, tmp_path, *sparse, env=env)
        procs.append(w4)
        for n in etcd.names:
            etcd.start(n)
        wait_for("w4 registered once etcd is back", lambda: workers_up(b.addr) == 4, timeout=60)
    finally:
        for p in procs:
            p.stop()
        etcd.stop()


def decoded(workers):
    """Tokens the workers have decoded since they started."""
    total = 0
    for w in workers:
        r = ddctl("stats", "--worker", w.addr)
        if r.returncode == 0:
            total += int(json.loads(r.stdout).get("decode_tokens_total", 0))
    return total


def test_only_members_with_the_etcd_password_and_the_cluster_secret_can_register(tmp_path):
    """etcd's own auth keeps out a worker without the password; the records' signature (HMAC with
    the cluster secret) keeps out a record written by anyone else who can write to etcd."""
    etcd = Etcd(tmp_path, members=1)
    endpoint = etcd.url[len("etcd://"):]

    def etcdctl(*args):
        r = subprocess.run(["etcdctl", f"--endpoints={endpoint}", *args], capture_output=True, text=True,
                           env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, timeout=60)
        assert r.returncode == 0, r.stderr

    procs = []
    try:
        etcdctl("user", "add", "root:root-password-0123")
        etcdctl("auth", "enable")
        good, bad = tmp_path / "good", tmp_path / "bad"
        for f, pw in ((good, "root-password-0123"), (bad, "not-the-password-0123")):
            f.write_text(pw + "\n")
            f.chmod(0o600)
        secret = secret_file(tmp_path, "s" * 40)
        auth = ["--etcd_user=root", f"--etcd_password_file={good}", f"--cluster_secret_file={secret}"]
        r = Proc("router", ["dd-router", f"--registry={etcd.url}", *auth], tmp_path)
        procs.append(r)

        def worker_with(name, *flags):
            return Proc(name, ["dd-decode-worker", f"--model={require_model()}", f"--registry={etcd.url}",
                               f"--worker_id={name}", "--threads=1", "--heartbeat_ms=200", *flags], tmp_path)

        intruder = worker_with("intruder", "--etcd_user=root", f"--etcd_password_file={bad}",
                               f"--cluster_secret_file={secret}")
        procs.append(intruder)
        wait_for("the intruder refused", lambda: "authentication failed" in intruder.log.read_text(), timeout=60)
        # Records written with etcd's credentials but without the cluster secret: unsigned, and
        # signed with another secret.
        forged = json.dumps({"workerId": "forged", "address": "127.0.0.1:9"})
        etcdctl("--user=root:root-password-0123", "put", "/dualdecoder/workers/forged", forged)
        etcdctl("--user=root:root-password-0123", "put", "/dualdecoder/workers/signed",
                "hmac-sha256:" + "0" * 64 + " " + forged.replace("forged", "signed"))
        honest = worker_with("honest", *auth)
        procs.append(honest)
        wait_for("the honest worker registered", lambda: workers_up(r.addr) >= 1, timeout=60)
        listed = json.loads(ddctl("workers", "--server", r.addr, "--json").stdout)["workers"]
        assert [w["worker_id"] for w in listed] == ["honest"], listed
        log = r.log.read_text()
        assert "unsigned record" in log and "not signed with this cluster's secret" in log, log
    finally:
        for p in procs:
            p.stop()
        etcd.stop()


def test_routers_and_workers_reach_etcd_over_mutual_tls(tmp_path):
    certs = make_certs(tmp_path)
    etcd = Etcd(tmp_path, members=1, tls=certs)
    tls = [f"--etcd_ca_file={certs['ca']}", f"--etcd_cert_file={certs['cert']}", f"--etcd_key_file={certs['key']}"]
    procs = []
    try:
        r = Proc("router", ["dd-router", f"--registry={etcd.url}", *tls], tmp_path)
        procs.append(r)
        procs.append(Proc("tls-w", ["dd-decode-worker", f"--model={require_model()}", f"--registry={etcd.url}",
                                    "--worker_id=tls-w", "--threads=1", "--heartbeat_ms=200", *tls], tmp_path))
        wait_for("the worker registered over TLS", lambda: workers_up(r.addr) == 1, timeout=60)
        # Without the client certificate etcd refuses the connection: no registration.
        plain = Proc("no-cert", ["dd-decode-worker", f"--model={require_model()}", f"--registry={etcd.url}",
                                 "--worker_id=no-cert", "--threads=1", "--heartbeat_ms=200", tls[0]], tmp_path)
        procs.append(plain)
        wait_for("the worker without a certificate refused",
                 lambda: "cannot get a lease" in plain.log.read_text(), timeout=60)
        assert workers_up(r.addr) == 1
    finally:
        for p in procs:
            p.stop()
        etcd.stop()


def test_each_replica_admits_its_share_of_a_tenants_in_flight_limit(tmp_path):
    """A tenant limited to 2 requests in flight, behind 2 replicas: each admits 1."""
    etcd = Etcd(tmp_path, members=1)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "team-a", "key": "a" * 40, "max_inflight": 2}]))
    keys.chmod(0o600)
    key = secret_file(tmp_path, "a" * 40)
    procs = []
    try:
        a, b = (Proc(n, ["dd-router", f"--registry={etcd.url}", f"--api_keys_file={keys}"], tmp_path) for n in "ab")
        procs += [a, b, worker("w1", etcd, tmp_path)]
        wait_for("two replicas and the worker", lambda: metric(a.metrics, "dd_router_replicas") == 2
                 and metric(b.metrics, "dd_worker_up{worker=\"w1\"}") == 1, timeout=60)
        held = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", a.addr, "--prompt", prompt(1),
                                 "--max_new_tokens", "2000", "--ignore_eos", "--events", f"--api_key_file={key}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert held.stdout.readline(), held.stderr.read()  # its first token: it is in flight on A
        more = ddctl("generate", "--server", a.addr, "--prompt", "Hi", "--max_new_tokens", "2",
                     f"--api_key_file={key}")
        assert more.returncode != 0 and "RESOURCE_EXHAUSTED" in more.stderr, more.stderr
        other = ddctl("generate", "--server", b.addr, "--prompt", "Hi", "--max_new_tokens", "2",
                      f"--api_key_file={key}")
        assert other.returncode == 0, other.stderr
        held.kill()
        held.wait()
    finally:
        for p in procs:
            p.stop()
        etcd.stop()
