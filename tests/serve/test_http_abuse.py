"""The HTTP endpoints of `ddctl serve` against clients that hold connections or leave: requests
and scrapes are served within a second beside a thousand idle or half-sent connections, one
address cannot take every connection, and a client that hangs up cancels its request at once
(within two prompt passes or 64 tokens) whether or not it streams."""
import http.client
import json
import resource
import socket
import time

import pytest

from serving import Proc, require_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_model()
    d = tmp_path_factory.mktemp("abuse")
    # Prompt passes of 256 tokens: a hang-up is acted on between passes, and the hang-up test
    # counts the work done after it in passes and tokens, not in seconds.
    p = Proc("serve", ["ddctl", "serve", "--model=smollm2", "--http_listen=127.0.0.1:0", "--threads=1",
                       "--step_tokens=256"], d)
    try:
        assert p.http, "no http address in the listening line"
        yield p
    finally:
        p.stop()


def split(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def open_idle(addr, sources, per_source, half_sent=0):
    """per_source connections from each source address; the first `half_sent` send half a line."""
    host, port = split(addr)
    socks = []
    for src in sources:
        for _ in range(per_source):
            s = socket.create_connection((host, port), timeout=5, source_address=(src, 0))
            if len(socks) < half_sent:
                s.sendall(b"GET /v1/mod")
            socks.append(s)
    return socks


def timed_get(addr, path, source):
    host, port = split(addr)
    t0 = time.monotonic()
    c = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body, time.monotonic() - t0


def test_requests_and_scrapes_are_served_beside_a_thousand_idle_connections(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2200:
        pytest.skip("this process may not open 2200 descriptors")
    idle = []
    try:
        # 1000 on the API from four addresses, 1000 on /metrics from twenty: under each
        # endpoint's per-address limit, so every one of them stays open.
        idle += open_idle(server.http, [f"127.0.0.{i}" for i in range(10, 14)], 250, half_sent=100)
        idle += open_idle(server.metrics, [f"127.0.0.{i}" for i in range(20, 40)], 50, half_sent=100)
        status, body, secs = timed_get(server.http, "/v1/models", "127.0.0.2")
        assert status == 200 and json.loads(body)["data"], body
        assert secs < 1.0, f"GET /v1/models took {secs:.2f} s beside 2000 idle connections"
        status, body, secs = timed_get(server.metrics, "/metrics", "127.0.0.3")
        assert status == 200 and b"dd_batch_size" in body, body[:200]
        assert secs < 1.0, f"a scrape took {secs:.2f} s beside 2000 idle connections"
        # An address at its limit is turned away at once; the others are not.
        host, port = split(server.http)
        for _ in range(6):  # 250 open + 6 reaches the default limit of 256 per address
            idle.append(socket.create_connection((host, port), timeout=5, source_address=("127.0.0.10", 0)))
        refused = socket.create_connection((host, port), timeout=5, source_address=("127.0.0.10", 0))
        assert refused.recv(200).startswith(b"HTTP/1.1 503"), "an address past its limit was not refused"
        refused.close()
    finally:
        for s in idle:
            s.close()


def metric(server, name):
    _, body, _ = timed_get(server.metrics, "/metrics", "127.0.0.1")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def batch_size(server):
    return metric(server, "dd_batch_size")


def wait_until(cond, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_client_that_hangs_up_frees_its_slot_at_once(server, stream, phase):
    # Prefill: a prompt long enough that its prefill outlasts the hang-up by seconds; decode: a
    # short prompt and a long generation.
    prompt = "Tell me a story. " if phase == "decode" else " ".join(f"item {i} is blue;" for i in range(700))
    body = json.dumps({"prompt": prompt, "max_tokens": 2000 if phase == "decode" else 4, "temperature": 0,
                       "stream": stream}).encode()
    first_tokens = metric(server, "dd_ttft_seconds_count")
    host, port = split(server.http)
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert wait_until(lambda: batch_size(server) >= 1, 30), "the request never started"
    if phase == "decode":
        assert wait_until(lambda: metric(server, "dd_ttft_seconds_count") > first_tokens, 30), "no first token"
    else:
        assert metric(server, "dd_ttft_seconds_count") == first_tokens, "the prompt was prefilled too soon"
    # What the request does after the hang-up is counted in engine work, which a loaded machine
    # slows as much as it slows the hang-up's detection (a tick of 100 ms): at most two prompt
    # passes of 256 tokens of a ~4000-token prompt, or 64 of 2000 tokens.
    prefilled, decoded = metric(server, "dd_prefill_tokens_total"), metric(server, "dd_decode_tokens_total")
    s.close()
    assert wait_until(lambda: batch_size(server) == 0, 30), "the request kept its slot after its client left"
    if phase == "prefill":
        more = metric(server, "dd_prefill_tokens_total") - prefilled
        assert more <= 2 * 256, f"{more:.0f} prompt tokens were prefilled after the hang-up"
        assert metric(server, "dd_ttft_seconds_count") == first_tokens, "the prompt was finished after the hang-up"
    else:
        more = metric(server, "dd_decode_tokens_total") - decoded
        assert more <= 64, f"{more:.0f} tokens were decoded after the hang-up"
