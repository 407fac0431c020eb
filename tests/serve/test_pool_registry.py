"""KV pools registered in etcd (docs/decisions/0051-registry-on-etcd.md, "Pools"): a worker run with
--kv_store registry://shm finds the pool of its node there, waits for one that is not up yet, and
when its pool dies and another takes its place at another address, finds the new one and finishes
its streams with the tokens of an undisturbed run. Real processes: etcd, dd-kv-pool, dd-router,
dd-decode-worker."""
import json
import os
import subprocess
import urllib.request

from serving import BIN, TOKEN, Etcd, Proc, ddctl, ddctl_json, require_model, secret_file, wait_for

TOKENS = 120
PROMPT = "The lighthouse keeper wrote in her log every night: " + "wind from the west, three ships seen. " * 12


def labelled(addr, name, having=""):
    """The sum of the samples of `name` on a /metrics page (labelled or not) whose line holds `having`."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return sum(float(line.split()[-1]) for line in r.read().decode().splitlines()
                   if (line.startswith(name + " ") or line.startswith(name + "{")) and having in line)


def test_workers_find_their_pool_in_etcd_and_follow_a_replaced_one(tmp_path):
    etcd = Etcd(tmp_path, members=1)
    secret = secret_file(tmp_path, "c" * 64)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([{"name": "serve", "token": TOKEN, "quota": "1GiB"}]))
    tenants.chmod(0o600)
    registered = (f"--registry={etcd.url}", f"--cluster_secret_file={secret}")
    env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)

    def pool(name, node):
        return Proc(name, ["dd-kv-pool", f"--tenants={tenants}", *registered, f"--pool_id={name}", f"--node={node}",
                           "--heartbeat_ms=200", "--lease_ttl_ms=3000"], tmp_path)

    def worker_args(name, node, *extra):
        return [str(BIN / "dd-decode-worker"), f"--model={require_model()}", *registered, f"--worker_id={name}",
                f"--node={node}", "--kv_store=registry://shm", "--mode=dualdecoder", "--budget=64", "--threads=1",
                "--heartbeat_ms=200", *extra]

    procs = []
    try:
        pool_a = pool("pool-a", "node-a")
        router = Proc("router", ["dd-router", *registered, "--heartbeat_timeout_ms=1500"], tmp_path)
        procs += [pool_a, router]
        w1 = Proc("w1", ["dd-decode-worker", *worker_args("w1", "node-a")[1:]], tmp_path, env=env)
        procs.append(w1)

        def workers():
            return json.loads(ddctl("workers", "--server", router.addr, "--json").stdout or "{}").get("workers", [])

        wait_for("w1 placed by the router", lambda: any(w["up"] for w in workers()))
        assert [w["kv_store"] for w in workers()] == [f"shm://{pool_a.addr}"]
        wait_for("the router counts the pool", lambda: labelled(router.metrics, "dd_registry_pools") == 1)

        # A worker started before its node's pool waits for it (with progress), then serves.
        w2_log = tmp_path / "w2.log"
        w2 = subprocess.Popen(worker_args("w2", "node-b"), stdout=subprocess.PIPE, stderr=w2_log.open("w"), text=True,
                              env=env)
        try:
            wait_for("w2 waiting for a pool on node-b",
                     lambda: "waiting for a KV pool on node node-b" in w2_log.read_text(), timeout=120)
            procs.append(pool("pool-b", "node-b"))
            assert "listening on" in w2.stdout.readline()
            wait_for("both workers placed", lambda: sum(w["up"] for w in workers()) == 2)
            assert f"shm://{procs[-1].addr}" in {w["kv_store"] for w in workers()}
            assert labelled(router.metrics, "dd_registry_pools") == 2
        finally:
            w2.terminate()
            w2.wait(timeout=60)
        wait_for("w2 gone", lambda: sum(w["up"] for w in workers()) == 1)

        # A node with no pool: the worker gives up after --kv_pool_wait_ms, saying why.
        lone = subprocess.run(worker_args("w3", "node-c", "--kv_pool_wait_ms=500"), capture_output=True, text=True,
                              timeout=120, env=env)
        assert lone.returncode != 0
        assert "no KV pool" in lone.stderr and "node 'node-c'" in lone.stderr, lone.stderr

        # The undisturbed run, then the same stream with pool-a SIGKILLed mid-way and pool-a2 (a
        # new process at a new address, as a replaced pod) registered on the node instead.
        want = ddctl_json("generate", "--server", router.addr, "--prompt", PROMPT, "--max_new_tokens", str(TOKENS),
                          "--ignore_eos")["tokens"]
        stream = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", router.addr, "--prompt", PROMPT,
                                   "--max_new_tokens", str(TOKENS), "--ignore_eos", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for("the stream's KV in pool-a", lambda: labelled(pool_a.metrics, "dd_pool_sequences") >= 1, timeout=120)
        pool_a.kill()
        pool_a2 = pool("pool-a2", "node-a")
        procs.append(pool_a2)
        assert pool_a2.addr != pool_a.addr
        out, err = stream.communicate(timeout=600)
        assert stream.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["tokens"] == want
        assert f"{pool_a.addr} is replaced by shm://{pool_a2.addr}" in w1.log.read_text()
        # The rebuilt stream's KV (and its committed prompt prefix) lives in the new pool.
        assert labelled(pool_a2.metrics, "dd_pool_bytes", 'state="used"') > 0
    finally:
        for p in reversed(procs):
            p.stop()
        etcd.stop()
