"""Streams that outlive their router (docs/decisions/0050-resumable-streams.md): a request the
client names keeps decoding on its worker when the router dies, and the client reconnects with
its id and the tokens it has; one that nobody reconnects to is cancelled after the grace window."""
import json
import subprocess

from serving import (BIN, Proc, ddctl, ddctl_json, free_port, metric, secret_file, start_worker, wait_for,
                     workers_up)


def prompt(i):
    return f"Story {i}: " + "the river flows past the old mill and the miller counts sacks of grain. " * 3


def stream(server, text, n, request_id, min_tokens, *extra):
    """A streaming ddctl, returned once `min_tokens` tokens have arrived, with the lines read."""
    p = subprocess.Popen([str(BIN / "ddctl"), "generate", "--server", server, "--prompt", text, "--max_new_tokens",
                          str(n), "--ignore_eos", "--events", f"--request_id={request_id}", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got, lines = 0, []
    while got < min_tokens:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        lines.append(line)
        got += len(json.loads(line).get("token_ids", []))
    return p, lines


def test_a_stream_survives_its_routers_death_with_exactly_its_tokens(tmp_path):
    port = free_port()
    router = Proc("router-a", ["dd-router", f"--listen=127.0.0.1:{port}", "--heartbeat_timeout_ms=1500"], tmp_path)
    worker = start_worker("keeper-w", router.addr, tmp_path)
    try:
        wait_for("worker up", lambda: workers_up(router.addr) == 1)
        want = ddctl_json("generate", "--server", router.addr, "--prompt", prompt(1), "--max_new_tokens", "200",
                          "--ignore_eos")["tokens"]
        p, before = stream(router.addr, prompt(1), 200, "story-1", 20)
        router.kill()  # SIGKILL mid-stream: the client's connection breaks
        router = Proc("router-b", ["dd-router", f"--listen=127.0.0.1:{port}", "--heartbeat_timeout_ms=1500"], tmp_path)
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "reconnecting" in err, err
        lines = [json.loads(line) for line in before + out.strip().splitlines()]
        done = lines[-1]
        assert done["tokens"] == want, (done["tokens"], want)
        # Each token arrived once: the streamed messages' indices run without a gap or repeat.
        seen = []
        for m in lines[:-1]:
            assert int(m.get("first_token_index", 0)) == len(seen), m
            seen += m.get("token_ids", [])
        assert seen == want
        assert done["usage"]["request_id"] == "story-1" and lines[0]["request_id"] == "story-1"
        assert metric(router.metrics, "dd_router_reconnects_total") == 1
    finally:
        worker.stop()
        router.stop()


def test_a_stream_nobody_reconnects_to_is_cancelled_after_the_grace_window(tmp_path):
    router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500"], tmp_path)
    worker = start_worker("grace-w", router.addr, tmp_path, "--stream_grace_ms=1500")
    try:
        wait_for("worker up", lambda: workers_up(router.addr) == 1)
        p, _ = stream(router.addr, prompt(2), 4000, "gone-1", 2)
        p.kill()  # the client goes away and never comes back
        p.wait()
        # Still decoding, its output kept, while the grace window runs...
        assert metric(worker.metrics, "dd_kept_streams") == 1
        assert metric(worker.metrics, "dd_batch_size") == 1
        # ...then cancelled: the slot and the kept output are freed.
        wait_for("the abandoned stream cancelled",
                 lambda: metric(worker.metrics, "dd_batch_size") == 0 and metric(worker.metrics, "dd_kept_streams") == 0,
                 timeout=30)
        assert metric(worker.metrics, "dd_kept_stream_bytes") == 0
        assert metric(worker.metrics, 'dd_worker_requests_total{outcome="cancelled"}') == 1
    finally:
        worker.stop()
        router.stop()


def test_a_named_stream_cancelled_by_its_tenant_stops_at_once(tmp_path):
    """DualDecoder.Cancel: the tenant that named a stream ends it through the router; the worker
    frees its slot and kept output at once instead of decoding on for the grace window. Another
    tenant's Cancel of the same id finds nothing and stops nothing."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "a", "key": "a" * 40}, {"tenant": "b", "key": "b" * 40}]))
    keys.chmod(0o600)
    key_a, key_b = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500", f"--api_keys_file={keys}"], tmp_path)
    worker = start_worker("cancel-w", router.addr, tmp_path, "--stream_grace_ms=60000")
    try:
        wait_for("worker up", lambda: metric(worker.metrics, "dd_batch_size") is not None)
        p, _ = stream(router.addr, prompt(3), 4000, "long-1", 2, f"--api_key_file={key_a}")
        wrong = ddctl("cancel", "--server", router.addr, "--request_id=long-1", f"--api_key_file={key_b}")
        assert wrong.returncode == 1 and "no stream" in wrong.stderr, wrong.stderr
        assert metric(worker.metrics, "dd_batch_size") == 1, "another tenant's cancel stopped nothing"
        done = ddctl("cancel", "--server", router.addr, "--request_id=long-1", f"--api_key_file={key_a}")
        assert done.returncode == 0 and "cancelled" in done.stdout, done.stderr
        out, err = p.communicate(timeout=120)
        assert p.returncode != 0 and "CANCELLED" in err, err
        wait_for("the slot and kept output freed",
                 lambda: metric(worker.metrics, "dd_batch_size") == 0 and metric(worker.metrics, "dd_kept_streams") == 0,
                 timeout=30)
        assert metric(worker.metrics, 'dd_worker_requests_total{outcome="cancelled"}') == 1
        again = ddctl("cancel", "--server", router.addr, "--request_id=long-1", f"--api_key_file={key_a}")
        assert again.returncode == 1 and "no stream" in again.stderr, again.stderr
        assert ddctl("cancel", "--server", router.addr, f"--api_key_file={key_a}").returncode == 2  # no id
    finally:
        worker.stop()
        router.stop()
