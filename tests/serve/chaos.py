"""Chaos under load (docs/decisions/0031-testing-strategy.md): streams of greedy requests through a
real cluster on loopback (one pool, one router, two dualdecoder workers with their KV in the pool)
while faults are injected at random: SIGKILL a worker and start it again, SIGKILL the pool and start
it at the same address, SIGKILL the router and start it at the same address.

What must hold: every request that completes has exactly the tokens of an undisturbed run (no
wrong, missing or repeated token); a worker or pool fault loses no request (the router resumes
on the other worker; the worker rebuilds from a restarted pool); a router restart fails the
streams it was relaying with UNAVAILABLE (retryable: the client sends them again), and
requests that could not connect while it was down are retried by the client.

    python3 tests/serve/chaos.py [--seconds 300] [--streams 6] [--seed 1] [--out chaos.json]
tests/serve/test_chaos.py runs a 45-second preset in scripts/test."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import BIN, TOKEN, Proc, ddctl_json, run_header, start_worker, workers_up  # noqa: E402


def prompt(i):
    return f"Report {i}: " + "the ferry crosses the bay twice a day and the harbour master logs each trip. " * (2 + i % 4)


def run_stream(router, text, n):
    """One request; returns (tokens, indices, rc, stderr, seconds to the first token)."""
    t0 = time.monotonic()
    p = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", router, "--prompt", text, "--max_new_tokens",
                          str(n), "--ignore_eos", "--events"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tokens, indices, ttft = [], [], None
    for line in p.stdout:
        m = json.loads(line)
        if m.get("token_ids") and "usage" not in m:
            if ttft is None:
                ttft = time.monotonic() - t0
            indices.append(int(m.get("first_token_index", 0)))
            tokens.extend(m["token_ids"])
    rc = p.wait(timeout=600)
    return tokens, indices, rc, p.stderr.read(), ttft


class Cluster:
    def __init__(self, log_dir):
        self.log_dir = Path(log_dir)
        self.cfg = self.log_dir / "tenants.json"
        self.cfg.write_text(json.dumps([{"name": "chaos", "token": TOKEN, "quota": "2GiB"}]))
        self.cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
        self.env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
        self.lock = threading.Lock()
        self.pool = Proc("pool", ["dd-kv-pool", f"--tenants={self.cfg}", "--lease_ttl_ms=3000"], self.log_dir)
        self.router = self._router()
        self.workers = {name: self._worker(name) for name in ("w1", "w2")}
        self.restarts = 0

    def _router(self, addr="127.0.0.1:0"):
        return Proc(f"router-{time.monotonic_ns()}", ["dd-router", f"--listen={addr}", "--heartbeat_timeout_ms=1500"],
                    self.log_dir)

    def _worker(self, name):
        return start_worker(name, self.router.addr, self.log_dir, "--mode=dualdecoder", "--budget=256",
                            f"--kv_store=shm://{self.pool.addr}", "--max_batch=8", "--pool_recovery_ms=60000",
                            env=self.env)

    def fault(self, kind, name=None):
        with self.lock:
            if kind == "worker":
                self.workers[name].kill()
                self.workers[name] = self._worker(name)
            elif kind == "pool":
                addr = self.pool.addr
                self.pool.kill()
                self.pool = Proc(f"pool-{time.monotonic_ns()}", ["dd-kv-pool", f"--tenants={self.cfg}",
                                                                 f"--listen={addr}", "--lease_ttl_ms=3000"], self.log_dir)
            elif kind == "router":
                addr = self.router.addr
                self.router.kill()
                self.router = self._router(addr)
            self.restarts += 1

    def stop(self):
        for p in [*self.workers.values(), self.router, self.pool]:
            p.stop()


def run(log_dir, seconds=45.0, streams=4, n=32, seed=1, kinds=("worker", "pool", "router"), prompts=6):
    rng = random.Random(seed)
    c = Cluster(log_dir)
    try:
        deadline = time.monotonic() + 120
        while workers_up(c.router.addr) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not come up")
            time.sleep(0.05)
        want = {}
        for i in range(prompts):
            out = ddctl_json("generate", "--server", c.router.addr, "--prompt", prompt(i), "--max_new_tokens", str(n),
                             "--ignore_eos")
            want[i] = out["tokens"]
        stats = {"completed": 0, "failed": 0, "retried": 0, "wrong": 0, "duplicated": 0, "failures": [], "ttft": []}
        stop_at = time.monotonic() + seconds
        slock = threading.Lock()

        def client(k):
            crng = random.Random(seed * 1000 + k)
            while time.monotonic() < stop_at:
                i = crng.randrange(prompts)
                for attempt in range(5):
                    tokens, indices, rc, err, ttft = run_stream(c.router.addr, prompt(i), n)
                    if rc != 0 and not tokens and "UNAVAILABLE" in err:  # not connected: send again
                        with slock:
                            stats["retried"] += 1
                        time.sleep(0.2)
                        continue
                    break
                with slock:
                    if rc == 0:
                        stats["completed"] += 1
                        stats["ttft"].append(ttft)
                        stats["wrong"] += tokens != want[i]
                        stats["duplicated"] += len(indices) != len(set(indices)) or indices != sorted(indices)
                    else:
                        stats["failed"] += 1
                        stats["failures"].append(err.strip().splitlines()[-1] if err.strip() else f"rc {rc}")

        faults = []

        def injector():
            while True:
                wait = rng.uniform(4.0, 8.0)
                if time.monotonic() + wait > stop_at - 2:
                    return
                time.sleep(wait)
                kind = rng.choice(kinds)
                name = rng.choice(sorted(c.workers)) if kind == "worker" else None
                faults.append({"at_s": round(seconds - (stop_at - time.monotonic()), 1), "kind": kind, "name": name})
                c.fault(kind, name)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
        threads.append(threading.Thread(target=injector))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ttft = sorted(x for x in stats.pop("ttft") if x is not None)
        stats["ttft_p50_s"] = ttft[len(ttft) // 2] if ttft else None
        stats["ttft_p99_s"] = ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None
        stats["faults"] = faults
        stats["seconds"] = seconds
        stats["streams"] = streams
        return stats
    finally:
        c.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    header = run_header("chaos.py", sys.argv[1:])
    with tempfile.TemporaryDirectory() as d:
        stats = run(d, a.seconds, a.streams, a.tokens, a.seed)
    stats = {**header, **stats}
    print(json.dumps(stats, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
