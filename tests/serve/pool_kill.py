"""Pool kill and restart, run after run: one dualdecoder worker with its KV in a real
`dd-kv-pool` (shm://) and a small selection budget, so that decode attends sparsely well before
the prompt ends; each run streams a greedy request, SIGKILLs the pool after a random number of
tokens, starts a new pool at the same address, and compares the finished stream with an
undisturbed run of the same prompt. The worker rebuilds the request's KV from the restarted
pool (docs/decisions/0024-pool-loss-recovery.md): its prompt prefilled, the tokens already
generated replayed as decode steps, so the stream must be identical every time.

    python3 tests/serve/pool_kill.py [--runs 50] [--tokens 64] [--seed 1] [--out pool-kill.json]
tests/serve/test_pool_kill.py runs a 3-run preset in scripts/test."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import BIN, TOKEN, Proc, ddctl, ddctl_json, run_header, start_worker, workers_up  # noqa: E402
import models  # noqa: E402  (serving puts eval/ on the path)

BUDGET = 64  # with 16 sink and 64 window tokens, decode is sparse past ~150 tokens of context


def prompt(i):  # ~500 tokens
    return f"Log {i}: " + " ".join(f"at step {j} the courier {chr(65 + (i + j) % 26)} carried parcel {j * 7 + i};"
                                   for j in range(45))


def worker_stats(addr):
    r = ddctl("stats", "--worker", addr)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def run(log_dir, runs=3, n=64, seed=1, prompts=4):
    """Returns {"runs", "identical", "rebuilt_runs", "differences": [...], ...}."""
    rng = random.Random(seed)
    log_dir = Path(log_dir)
    cfg = log_dir / "tenants.json"
    cfg.write_text(json.dumps([{"name": "kill", "token": TOKEN, "quota": "1GiB"}]))
    cfg.chmod(0o600)
    env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
    pool = Proc("pool", ["dd-kv-pool", f"--tenants={cfg}", "--lease_ttl_ms=3000"], log_dir)
    router = worker = None
    try:
        router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500"], log_dir)
        worker = start_worker("w", router.addr, log_dir, f"--model={models.model_path('smollm2')}", "--threads=2",
                              "--mode=dualdecoder", f"--budget={BUDGET}", f"--kv_store=shm://{pool.addr}",
                              "--max_batch=4", "--pool_recovery_ms=60000", "--prefix_block=0", env=env)
        deadline = time.monotonic() + 120
        while workers_up(router.addr) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not come up")
            time.sleep(0.05)
        want = [ddctl_json("generate", "--server", router.addr, "--prompt", prompt(i), "--max_new_tokens", str(n),
                           "--ignore_eos")["tokens"] for i in range(prompts)]
        stats = {"runs": 0, "identical": 0, "rebuilt_runs": 0, "failed": 0, "differences": [], "kill_at_tokens": []}
        for r in range(runs):
            i = r % prompts
            kill_at = rng.randrange(2, n // 2)
            rebuilt_before = int(worker_stats(worker.addr).get("requests_rebuilt", 0))
            p = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", router.addr, "--prompt", prompt(i),
                                  "--max_new_tokens", str(n), "--ignore_eos", "--events"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            tokens, killed = [], False
            for line in p.stdout:
                m = json.loads(line)
                if "usage" not in m:
                    tokens.extend(m.get("token_ids", []))
                if not killed and len(tokens) >= kill_at:
                    addr = pool.addr
                    pool.kill()
                    pool = Proc(f"pool-{r}", ["dd-kv-pool", f"--tenants={cfg}", f"--listen={addr}",
                                              "--lease_ttl_ms=3000"], log_dir)
                    killed = True
            rc = p.wait(timeout=600)
            stats["runs"] += 1
            stats["kill_at_tokens"].append(kill_at)
            if rc != 0:
                stats["failed"] += 1
                stats["differences"].append({"run": r, "error": p.stderr.read().strip()[-300:]})
                continue
            stats["rebuilt_runs"] += int(worker_stats(worker.addr).get("requests_rebuilt", 0)) > rebuilt_before
            if tokens == want[i]:
                stats["identical"] += 1
            else:
                first = next(k for k, (a, b) in enumerate(zip(tokens, want[i])) if a != b) if len(tokens) == len(
                    want[i]) else min(len(tokens), len(want[i]))
                stats["differences"].append({"run": r, "prompt": i, "first_difference_at_token": first})
        stats.update({"tokens": n, "budget": BUDGET, "prompts": prompts, "seed": seed, "model": "smollm2",
                      "mode": "dualdecoder"})
        return stats
    finally:
        for proc in (worker, router, pool):
            if proc is not None:
                proc.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    header = run_header("pool_kill.py", sys.argv[1:])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        stats = run(d, a.runs, a.tokens, a.seed)
    stats = {**header, "seconds": round(time.monotonic() - t0, 1), **stats}
    print(json.dumps(stats, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
