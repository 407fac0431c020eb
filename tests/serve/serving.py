"""Helpers for the serving tests: real processes on loopback: dd-kv-pool, dd-router, dd-decode-worker,
etcd. Every process of ours listens on port 0 and prints the address it got; etcd, which cannot, gets
ports the OS just handed out; nothing uses a fixed port."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "eval"))
import models  # noqa: E402

BIN = Path(os.environ.get("DD_BIN_DIR", REPO / "build" / "bin"))
TOKEN = "serve-test-token-0123456789"


def make_certs(directory):
    """A throwaway CA and one certificate it signs for 127.0.0.1 (server and client use)."""
    d = Path(directory)
    ca_key, ca, key, csr, cert = (d / n for n in ("ca.key", "ca.pem", "node.key", "node.csr", "node.pem"))
    ext = d / "node.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["openssl", "req", "-x509", *ec, "-days", "1", "-subj", "/CN=dd-test-ca", "-keyout", ca_key, "-out", ca],
                ["openssl", "req", *ec, "-subj", "/CN=dd-node", "-keyout", key, "-out", csr],
                ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
                 "-extfile", ext, "-out", cert]):
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return {"ca": ca, "cert": cert, "key": key}


def secret_file(directory, secret):
    """A cluster secret file as the services expect it: one line, mode 0600."""
    path = Path(directory) / f"secret-{abs(hash(secret)) % 10**8}"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


def run_header(script, argv):
    """The command line and the git sha (with "-dirty" for uncommitted changes to tracked files)
    that a results file records, for the drivers that write one (chaos.py, pool_kill.py)."""
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    sha = git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    return {"command": " ".join(["python3", f"tests/serve/{script}", *argv]), "git_sha": sha}


def require_model():
    p = models.model_path()
    if not p.is_file():
        if os.environ.get("DD_REQUIRE_MODEL") == "1":
            pytest.fail(f"model missing at {p}; run scripts/fetch-model", pytrace=False)
        pytest.skip(f"model not fetched: {p}")
    return p


class Proc:
    """A service process; `addr` and `metrics` come from its 'listening on' line."""

    def __init__(self, name, args, log_dir, env=None):
        exe = BIN / args[0]
        if not exe.is_file():
            pytest.fail(f"{args[0]} not built at {exe}", pytrace=False)
        self.name = name
        self.log = Path(log_dir) / f"{name}.log"
        self.proc = subprocess.Popen([str(exe), *args[1:]], stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, env=env)
        line = self.proc.stdout.readline()  # blocks until serving (or the process exits)
        if "listening on" not in line:
            self.proc.kill()
            pytest.fail(f"{name} did not start: {line!r}\n{self.log.read_text()}", pytrace=False)
        words = line.split()
        self.addr = words[words.index("on") + 1]
        self.metrics = words[words.index("metrics") + 1]
        self.internal = words[words.index("internal") + 1] if "internal" in words else None
        self.http = words[words.index("http") + 1] if "http" in words else None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def ddctl(*args, timeout=300):
    exe = BIN / "ddctl"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


def ddctl_json(*args, timeout=300):
    r = ddctl(*args, "--json", timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_for(what, predicate, timeout=60.0):
    """Polls `predicate` until it returns a truthy value (no fixed sleeps in the tests)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}", pytrace=False)
        time.sleep(0.05)


def workers_up(router):
    r = ddctl("workers", "--server", router, "--json")
    if r.returncode != 0:
        return 0
    return sum(1 for w in json.loads(r.stdout).get("workers", []) if w["up"])


def start_worker(name, router, log_dir, *extra, env=None):
    model = require_model()
    return Proc(name, ["dd-decode-worker", f"--model={model}", f"--router={router}", f"--worker_id={name}",
                       "--threads=1", "--heartbeat_ms=200", *extra], log_dir, env=env)


def free_port():
    with socket.socket() as s:  # for servers that must be told their port up front (etcd)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """An etcd cluster of `members` real etcd processes on loopback (Debian's etcd-server)."""

    def __init__(self, log_dir, members=3, tls=None):
        """`tls`: make_certs() files; the members then serve clients over TLS only and require
        client certificates signed by that CA."""
        exe = shutil.which("etcd")
        if exe is None:
            pytest.fail("etcd is not installed (scripts/install-deps installs etcd-server)", pytrace=False)
        self.dir = Path(log_dir)
        self.names = [f"etcd{i}" for i in range(members)]
        self.tls = tls
        self.client = {n: free_port() for n in self.names}
        self.peer = {n: free_port() for n in self.names}
        self.health = {n: free_port() for n in self.names}  # plain HTTP /health beside TLS clients
        self.cluster = ",".join(f"{n}=http://127.0.0.1:{self.peer[n]}" for n in self.names)
        self.procs = {}
        for n in self.names:
            self.start(n)
        self.url = "etcd://" + ",".join(f"127.0.0.1:{self.client[n]}" for n in self.names)
        wait_for("etcd healthy", self.healthy, timeout=60)

    def start(self, n):
        c, p = self.client[n], self.peer[n]
        scheme = "https" if self.tls else "http"
        tls = ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"]), "--trusted-ca-file",
               str(self.tls["ca"]), "--client-cert-auth"] if self.tls else []
        self.procs[n] = subprocess.Popen(
            [shutil.which("etcd"), "--name", n, "--data-dir", str(self.dir / f"{n}.data"),
             "--listen-client-urls", f"{scheme}://127.0.0.1:{c}", "--advertise-client-urls", f"{scheme}://127.0.0.1:{c}",
             "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
             "--listen-metrics-urls", f"http://127.0.0.1:{self.health[n]}",
             "--initial-cluster", self.cluster, "--initial-cluster-state", "new", *tls],
            stdout=subprocess.DEVNULL, stderr=(self.dir / f"{n}.log").open("a"))

    def healthy(self):
        for n in self.names:
            if self.procs[n].poll() is not None:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health[n]}/health", timeout=2) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return True
            except OSError:
                pass
        return False

    def kill(self, n):
        self.procs[n].send_signal(signal.SIGKILL)
        self.procs[n].wait(timeout=30)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)


def metric(addr, name):
    """The value of one unlabelled (or fully labelled) sample on a /metrics page; None if absent."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None
