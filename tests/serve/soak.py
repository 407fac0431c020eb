"""Soak (docs/decisions/0031-testing-strategy.md): N requests through a real cluster on loopback
(pool, router, two dualdecoder workers), `--concurrency` at a time. Reports the RSS of every process
after the warm-up and at the end (stable within 10% is the target), and what is left when the load
is gone: leased pool bytes, pool sequences, active requests and reserved device memory on the
workers (all must be zero). By hand; it takes a while:
    python3 tests/serve/soak.py [--requests 2000] [--concurrency 8] [--out soak.json]"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import TOKEN, Proc, ddctl, run_header, start_worker, wait_for, workers_up  # noqa: E402


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def metric(addr, name):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as f:
        page = f.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    header = run_header("soak.py", sys.argv[1:])
    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "tenants.json"
        cfg.write_text(json.dumps([{"name": "soak", "token": TOKEN, "quota": "2GiB"}]))
        cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
        env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
        pool = Proc("pool", ["dd-kv-pool", f"--tenants={cfg}"], d)
        router = Proc("router", ["dd-router"], d)
        workers = [start_worker(n, router.addr, d, "--mode=dualdecoder", "--budget=256",
                                f"--kv_store=shm://{pool.addr}", "--max_batch=8", env=env) for n in ("w1", "w2")]
        procs = {"pool": pool, "router": router, **{w.name: w for w in workers}}
        try:
            wait_for("workers", lambda: workers_up(router.addr) == 2, timeout=120)

            def one(i):
                text = f"Soak {i}: " + "the lighthouse keeper writes the weather in the log. " * (1 + i % 5)
                r = ddctl("generate", "--server", router.addr, "--prompt", text, "--max_new_tokens", str(a.tokens),
                          "--ignore_eos", "--json")
                return r.returncode

            warm = max(1, a.requests // 10)
            with ThreadPoolExecutor(a.concurrency) as ex:
                codes = list(ex.map(one, range(warm)))
                after_warmup = {k: rss_mib(p.proc.pid) for k, p in procs.items()}
                codes += list(ex.map(one, range(warm, a.requests)))
            at_end = {k: rss_mib(p.proc.pid) for k, p in procs.items()}
            growth = {k: (at_end[k] / after_warmup[k] - 1) for k in procs if after_warmup[k]}
            left = {"pool_leased_bytes": metric(pool.metrics, 'dd_pool_bytes{tenant="soak",state="leased"}'),
                    "pool_sequences": metric(pool.metrics, "dd_pool_sequences")}
            for w in workers:
                s = json.loads(ddctl("stats", "--worker", w.addr).stdout)
                left[f"{w.name}_active"] = s["load"]["active_requests"]
                left[f"{w.name}_reserved_bytes"] = int(s["reserved_device_bytes"])
            out = {**header,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "requests": a.requests, "failed": sum(c != 0 for c in codes), "rss_mib_after_warmup": after_warmup,
                   "rss_mib_at_end": at_end, "rss_growth": growth, "left_behind": left,
                   "stable_within_10pct": all(g <= 0.10 for g in growth.values())}
        finally:
            for p in procs.values():
                p.stop()
    out["shm_entries_left"] = sorted(set(os.listdir("/dev/shm")) - shm_before)
    print(json.dumps(out, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))
    return 0 if out["failed"] == 0 and out["stable_within_10pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
