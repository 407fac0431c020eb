"""The HTTP front against an unauthenticated attacker on the same host (docs/operations.md,
"Security"): no header byte can kill the process, a body is neither buffered nor parsed before
its API key is checked, and a few addresses of idle connections cannot lock legitimate clients
(or scrapes) out. Real `dd-router` processes, keyed and open, with no workers: every path here
ends before a worker would be asked."""
import http.client
import json
import random
import resource
import socket
import time
from pathlib import Path

import pytest

from serving import Proc, ddctl

KEY = "pre-auth-test-key-0123456789abcdef0123"


def split(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    d = tmp_path_factory.mktemp("preauth")
    keys = d / "keys.json"
    keys.write_text(json.dumps([{"tenant": "a", "key": KEY}]))
    keys.chmod(0o600)
    procs = {}
    try:
        procs["keyed"] = Proc("keyed", ["dd-router", "--http_listen=127.0.0.1:0", f"--api_keys_file={keys}"], d)
        procs["open"] = Proc("open", ["dd-router", "--http_listen=127.0.0.1:0"], d)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def exchange(addr, raw, source="127.0.0.1", timeout=10):
    """Sends `raw` and returns everything the server answers until it closes."""
    s = socket.create_connection(split(addr), timeout=timeout, source_address=(source, 0))
    try:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the body was read: the answer is still there to read
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def status_of(answer):
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def get_models(addr, key=None, source="127.0.0.1"):
    t0 = time.monotonic()
    c = http.client.HTTPConnection(*split(addr), timeout=10, source_address=(source, 0))
    c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body, time.monotonic() - t0


def rss_mib(proc):
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("which", ["keyed", "open"])
def test_a_thousand_requests_with_random_authorization_bytes_leave_the_server_alive(routers, which):
    p = routers[which]
    rng = random.Random(20261206)
    # Bytes gRPC metadata cannot carry (a tab, UTF-8, controls, DEL, a lone LF or CR, NUL), and
    # printable ones, mixed.
    alphabet = [bytes([b]) for b in range(256)] + [b"\xc3\xa9", b"\t", b"\n", b"\r"] * 8
    seen = {}
    for i in range(1000):
        value = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        if b"\r\n" in value:
            value = value.replace(b"\r\n", b"\r")  # keep it one header
        target = b"GET /v1/models" if i % 2 == 0 else b"POST /v1/completions"
        body = b'{"prompt": "hi", "max_tokens": 1}' if i % 2 else b""
        raw = (target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + value +
               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        code = status_of(exchange(p.http, raw))
        seen[code] = seen.get(code, 0) + 1
        assert p.proc.poll() is None, f"the router died on request {i}: Authorization {value!r}"
    # Refused as a bad request (unprintable) or an unknown key (keyed); on the open router a
    # printable value reaches the API, which has no worker to serve a completion.
    assert set(seen) <= ({400, 401} if which == "keyed" else {200, 400, 503}), seen
    assert seen.get(400, 0) > 500, seen
    status, _, _ = get_models(p.http, KEY if which == "keyed" else None)
    assert status == 200


def nested_body(size=8 << 20):
    return b"[" * (size // 2) + b"]" * (size // 2)


def test_deeply_nested_8mib_bodies_cost_no_memory_with_or_without_a_key(routers):
    p = routers["keyed"]
    start = rss_mib(p)
    body = nested_body()
    for key in (None, KEY):
        for _ in range(12):
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                    (f"Authorization: Bearer {key}\r\n".encode() if key else b"") +
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            answer = exchange(p.http, head + body)
            # Without a key: 401 before the body is read. With one: the body is read, and its
            # depth refused before a document is built.
            assert status_of(answer) == (400 if key else 401), answer[:300]
            if key:
                assert b"nests deeper than" in answer, answer[:300]
        grown = rss_mib(p) - start
        assert grown < 100, f"RSS grew {grown:.0f} MiB after 12 nested 8 MiB bodies (key: {key is not None})"
    assert p.proc.poll() is None


def open_idle(addr, sources, per_source):
    host, port = split(addr)
    socks = []
    for src in sources:
        for _ in range(per_source):
            socks.append(socket.create_connection((host, port), timeout=5, source_address=(src, 0)))
    return socks


@pytest.mark.parametrize("endpoint", ["http", "metrics"])
def test_a_request_is_served_within_a_second_beside_5000_idle_connections(routers, endpoint):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 12000)), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 5200:
        pytest.skip("this process may not open 5200 descriptors")
    p = routers["keyed"]
    addr = getattr(p, endpoint)
    # More than the table holds (4096): 25 addresses under the API's per-address cap of 256;
    # /metrics caps an address at 64, so 100 addresses there.
    sources, per = ([f"127.0.1.{i}" for i in range(25)], 200) if endpoint == "http" else \
                   ([f"127.0.2.{i}" for i in range(100)], 50)
    idle = []
    try:
        idle = open_idle(addr, sources, per)
        if endpoint == "http":
            status, body, secs = get_models(addr, KEY, source="127.0.3.1")
            assert status == 200, body
        else:
            t0 = time.monotonic()
            c = http.client.HTTPConnection(*split(addr), timeout=10, source_address=("127.0.3.2", 0))
            c.request("GET", "/metrics")
            r = c.getresponse()
            body = r.read()
            secs = time.monotonic() - t0
            assert r.status == 200 and b"dd_router_inflight" in body, body[:200]
        assert secs < 1.0, f"served in {secs:.2f} s beside {len(idle)} idle connections"
    finally:
        for s in idle:
            s.close()


def test_a_request_id_that_would_write_its_own_log_line_is_refused(routers):
    r = ddctl("generate", "--server", routers["open"].addr, "--prompt", "hi", "--request_id",
              "x\nE1206 00:00:00.000000 forged log line")
    assert r.returncode != 0 and "INVALID_ARGUMENT" in r.stderr and "printable ASCII" in r.stderr, r.stderr
