"""Streams that outlive their router (docs/decisions/0050-resumable-streams.md): a request the
client names keeps decoding on its worker when the router dies, and the client reconnects with
its id and the tokens it has; one that nobody reconnects to is cancelled after the grace window."""
import json
import subprocess

from serving import BIN, Proc, ddctl_json, free_port, metric, start_worker, wait_for, workers_up


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
