"""The engine with its KV in a real dd-kv-pool process (shm:// data path, gRPC control plane)
gives exactly the tokens of the in-process store, in both sparse modes."""
import json
import os
import subprocess

import pytest

from test_ddctl import BIN, ddctl, tiny  # noqa: F401  (fixture)

TOKEN = "cli-test-token-0123456789"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    exe = BIN / "dd-kv-pool"
    if not exe.is_file():
        pytest.fail(f"dd-kv-pool not built at {exe}", pytrace=False)
    cfg = tmp_path_factory.mktemp("pool") / "tenants.json"
    cfg.write_text(json.dumps([{"name": "cli", "token": TOKEN, "quota": "64MiB"}]))
    proc = subprocess.Popen([str(exe), f"--tenants={cfg}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the pool serves (or exits)
    if "listening on" not in line:
        proc.kill()
        pytest.fail(f"dd-kv-pool did not start: {line!r} {proc.stderr.read()}", pytrace=False)
    yield line.rsplit(" ", 1)[1].strip()
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["sparse", "dualdecoder"])
def test_pool_store_matches_inproc(tiny, pool, mode):  # noqa: F811
    args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 40,
            "--max_new_tokens", "10", "--ignore_eos", "--json", "--budget", "64", "--mode", mode]
    env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
    local = ddctl(*args)
    remote = ddctl(*args, "--kv_store", f"shm://{pool}", env=env)
    assert local.returncode == 0 and remote.returncode == 0, local.stderr + remote.stderr
    jl, jr = json.loads(local.stdout), json.loads(remote.stdout)
    assert jl["tokens"] == jr["tokens"]
    assert jr["fetched_chunks"] > 0


def test_pool_errors_are_clear(tiny, pool):  # noqa: F811
    args = ["generate", "--model", str(tiny), "--prompt", "hi there", "--mode", "sparse", "--max_new_tokens", "2"]
    wrong = ddctl(*args, "--kv_store", f"shm://{pool}", env=dict(os.environ, DD_KV_POOL_TOKEN="not-the-token-000000"))
    assert wrong.returncode != 0 and "unknown bearer token" in wrong.stderr, wrong.stderr
    bad = ddctl(*args, "--kv_store", "tcp://nowhere")
    assert bad.returncode != 0 and "expected inproc:// or shm://" in bad.stderr, bad.stderr
