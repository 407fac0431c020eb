"""The engine with its KV in a real dd-kv-pool process (shm:// data path, gRPC control plane)
gives exactly the tokens of the in-process store, in both sparse modes."""
import json
import os
import subprocess
from pathlib import Path

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
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    proc = subprocess.Popen([str(exe), f"--tenants={cfg}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the pool serves (or exits)
    if "listening on" not in line:
        proc.kill()
        pytest.fail(f"dd-kv-pool did not start: {line!r} {proc.stderr.read()}", pytrace=False)
    yield line.split()[3]  # "dd-kv-pool: listening on HOST:PORT metrics HOST:PORT"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("scheme", ["shm", "ucx"])
@pytest.mark.parametrize("mode", ["sparse", "dualdecoder"])
def test_pool_store_matches_inproc(tiny, pool, mode, scheme):  # noqa: F811
    args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 40,
            "--max_new_tokens", "10", "--ignore_eos", "--json", "--budget", "64", "--mode", mode]
    env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
    local = ddctl(*args)
    remote = ddctl(*args, "--kv_store", f"{scheme}://{pool}", env=env)
    assert local.returncode == 0 and remote.returncode == 0, local.stderr + remote.stderr
    jl, jr = json.loads(local.stdout), json.loads(remote.stdout)
    assert jl["tokens"] == jr["tokens"]
    assert jr["fetched_chunks"] > 0


def test_pool_errors_are_clear(tiny, pool):  # noqa: F811
    args = ["generate", "--model", str(tiny), "--prompt", "hi there", "--mode", "sparse", "--max_new_tokens", "2"]
    wrong = ddctl(*args, "--kv_store", f"shm://{pool}", env=dict(os.environ, DD_KV_POOL_TOKEN="not-the-token-000000"))
    assert wrong.returncode != 0 and "unknown bearer token" in wrong.stderr, wrong.stderr
    bad = ddctl(*args, "--kv_store", "tcp://nowhere")
    assert bad.returncode != 0 and "expected inproc://" in bad.stderr, bad.stderr


@pytest.mark.parametrize("scheme", ["shm", "ucx"])
def test_prefix_reuse_across_processes(tiny, pool, scheme):  # noqa: F811
    """A second ddctl process whose prompt shares a prefix with the first restores it from
    the pool (prefix_reused_tokens > 0) and generates the tokens a fresh prefill gives."""
    env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)
    base = ["generate", "--model", str(tiny), "--max_new_tokens", "8", "--ignore_eos", "--json", "--budget", "64",
            "--mode", "dualdecoder"]
    shared = f"{scheme} shared prefix " + "the lazy dog sleeps " * 40
    pooled = [*base, "--kv_store", f"{scheme}://{pool}", "--prefix_block", "64"]
    first = ddctl(*pooled, "--prompt", shared + "and then", env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["prefix_reused_tokens"] == 0
    second = ddctl(*pooled, "--prompt", shared + "while the cat", env=env)
    assert second.returncode == 0, second.stderr
    fresh = ddctl(*base, "--prompt", shared + "while the cat")
    js, jf = json.loads(second.stdout), json.loads(fresh.stdout)
    assert js["prefix_reused_tokens"] >= 64 and js["prefix_reused_tokens"] % 64 == 0
    assert js["tokens"] == jf["tokens"]


def test_pool_refuses_ucx_over_tcp_unless_told(tmp_path):
    """UCX's tcp lets any peer write the pool's memory: a pool asked for tcp in UCX_TLS without
    --ucx_tcp exits with a message naming the flag; with it, the pool starts and warns."""
    exe = BIN / "dd-kv-pool"
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "cli", "token": TOKEN, "quota": "8MiB"}]))
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    env = dict(os.environ, UCX_TLS="tcp,sm,self")
    refused = subprocess.run([str(exe), f"--tenants={cfg}"], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "--ucx_tcp" in refused.stderr and "names tcp" in refused.stderr, refused.stderr
    proc = subprocess.Popen([str(exe), f"--tenants={cfg}", "--ucx_tcp"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "can write its memory" in err, err


def test_pool_refuses_one_sided_access_it_cannot_confine(tmp_path):
    """--ucx_rma over tcp or shared memory: a one-sided get outside the region crashed the pool
    (measured: a get at 1 TiB past the region's base ended the pool over both). Unless UCX_TLS
    limits UCX to RDMA transports (whose keys the NIC confines), the pool refuses it, naming why
    and the flag that takes the risk knowingly, whether or not the host has an RDMA device."""
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "cli", "token": TOKEN, "quota": "8MiB"}]))
    cfg.chmod(0o600)

    def pool(tls):
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        if tls is not None:
            env["UCX_TLS"] = tls
        p = subprocess.Popen([str(BIN / "dd-kv-pool"), f"--tenants={cfg}", "--ucx_rma", "--listen=127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            p.stdout.readline()  # the listening line, or EOF when it exits
        finally:
            p.kill()
        return p.wait(), p.stderr.read()

    for tls in (None, "sm,self", "rc,sm", "^tcp"):
        code, err = pool(tls)
        assert code == 2 and "crashes the pool" in err and "--ucx_rma_unconfined" in err, (tls, err)
    code, err = pool("rc,ud,self")  # RDMA only: allowed (UCX may still find no such device here)
    assert "crashes the pool" not in err, err


def test_pool_over_tls(tiny, tmp_path):  # noqa: F811
    """--tls_cert/--tls_key serve the control plane over TLS; a client trusting the CA
    ($DD_KV_POOL_CA) works, one without it is refused with a clear error."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    gen = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                          "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                         capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "cli", "token": TOKEN, "quota": "64MiB"}]))
    cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
    proc = subprocess.Popen([str(BIN / "dd-kv-pool"), f"--tenants={cfg}", f"--tls_cert={cert}", f"--tls_key={key}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read()
        addr = line.split()[3]
        args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 20, "--max_new_tokens", "4",
                "--ignore_eos", "--json", "--mode", "sparse", "--budget", "64", "--kv_store", f"shm://{addr}"]
        ok = ddctl(*args, env=dict(os.environ, DD_KV_POOL_TOKEN=TOKEN, DD_KV_POOL_CA=str(cert)))
        assert ok.returncode == 0, ok.stderr
        plain = ddctl(*args, env=dict(os.environ, DD_KV_POOL_TOKEN=TOKEN))
        assert plain.returncode != 0 and "kv pool handshake" in plain.stderr, plain.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pool_refuses_a_tenants_file_others_can_read(tmp_path):
    """The tenants file holds every tenant's token: a pool started with one that group or others
    may read exits 2 naming the fix, before it listens."""
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps([{"name": "cli", "token": TOKEN, "quota": "8MiB"}]))
    cfg.chmod(0o644)
    r = subprocess.run([str(BIN / "dd-kv-pool"), f"--tenants={cfg}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "accessible to group or others (chmod 600 it)" in r.stderr, r.stderr
