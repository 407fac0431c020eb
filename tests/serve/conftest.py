"""The serving tests' shared cluster: one pool, one router, two decode workers."""
import json
import os

import pytest

from serving import TOKEN, Proc, require_model, secret_file, start_worker, wait_for, workers_up

CLUSTER_SECRET = "cluster-secret-for-the-serving-tests-0123456789"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One pool, one router, two dualdecoder workers whose offloaded KV lives in the pool."""
    require_model()
    logs = tmp_path_factory.mktemp("cluster")
    cfg = logs / "tenants.json"
    cfg.write_text(json.dumps([{"name": "serve", "token": TOKEN, "quota": "4GiB"}]))
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    secret = secret_file(logs, CLUSTER_SECRET)
    procs = []
    try:
        pool = Proc("pool", ["dd-kv-pool", f"--tenants={cfg}"], logs)
        procs.append(pool)
        router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500", "--max_new_tokens_limit=4096",
                                 f"--cluster_secret_file={secret}"], logs)
        procs.append(router)
        env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
        workers = {}
        for name in ("w1", "w2"):
            workers[name] = start_worker(name, router.addr, logs, "--mode=dualdecoder", "--budget=256",
                                         f"--kv_store=shm://{pool.addr}", "--max_batch=8",
                                         f"--cluster_secret_file={secret}", env=env)
            procs.append(workers[name])
        wait_for("two workers up", lambda: workers_up(router.addr) == 2)
        yield {"router": router, "workers": workers, "pool": pool, "logs": logs, "secret": secret}
    finally:
        for p in reversed(procs):
            p.stop()
