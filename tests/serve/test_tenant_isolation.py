"""What one API tenant can learn of another through placement (docs/operations.md, "What tenants
learn of one another"): a keyed router with two real workers. Tenant A sends documents; tenant B
tries to tell which candidates A sent from where its own copies are placed. The router's
affinity is scoped by tenant, so B's placement does not depend on A's prompts (before, a
candidate A had sent followed A's to A's worker), and without --expose_worker_id B does not even
see where its requests went."""
import json
import threading
from pathlib import Path

import pytest

from serving import Proc, ddctl, ddctl_json, require_model, secret_file, start_worker, wait_for, workers_up

GPL = Path("/usr/share/common-licenses/GPL-3")


def documents():
    # Eight distinct ~1.5 KB texts: the router keys placement on a prompt's first 1 KiB.
    text = GPL.read_text()
    return [f"Document {i}.\n" + text[3000 * i:3000 * i + 1500] + "\nSummary:" for i in range(8)]


@pytest.fixture(scope="module", params=[True, False], ids=["worker_id_exposed", "worker_id_hidden"])
def cluster(request, tmp_path_factory):
    require_model()
    d = tmp_path_factory.mktemp("isolation")
    keys = d / "keys.json"
    keys.write_text(json.dumps([{"tenant": "a", "key": "a" * 40}, {"tenant": "b", "key": "b" * 40}]))
    keys.chmod(0o600)
    op = secret_file(d, "o" * 40)
    router = Proc("router", ["dd-router", "--heartbeat_timeout_ms=1500", f"--api_keys_file={keys}",
                             f"--operator_key_file={op}", *(["--expose_worker_id"] if request.param else [])], d)
    workers = []
    try:
        for name in ("w1", "w2"):
            workers.append(start_worker(name, router.addr, d, "--prefix_block=0"))
        wait_for("two workers up", lambda: workers_up_keyed(router.addr, op) == 2)
        yield {"router": router, "op": op, "a": secret_file(d, "a" * 40), "b": secret_file(d, "b" * 40),
               "dir": d, "exposed": request.param}
    finally:
        for w in workers:
            w.stop()
        router.stop()


def workers_up_keyed(addr, op):
    r = ddctl("workers", "--server", addr, f"--api_key_file={op}", "--json")
    return sum(1 for w in json.loads(r.stdout).get("workers", []) if w["up"]) if r.returncode == 0 else 0


def idle(c):
    """Every worker reports no active tokens, so placement is decided by the router alone."""
    r = ddctl("workers", "--server", c["router"].addr, f"--api_key_file={c['op']}", "--json")
    return r.returncode == 0 and all(int(w.get("active_tokens", 0)) == 0 and int(w.get("inflight", 0)) == 0
                                     for w in json.loads(r.stdout)["workers"])


def send(c, key, text, out=None, i=None):
    f = c["dir"] / f"prompt-{abs(hash(text)) % 10**8}.txt"
    f.write_text(text)
    usage = ddctl_json("generate", "--server", c["router"].addr, "--prompt_file", str(f), "--max_new_tokens", "1",
                       "--raw_prompt", f"--api_key_file={key}")["usage"]
    if out is not None:
        out[i] = usage
    return usage


def test_a_tenant_cannot_tell_which_documents_another_sent(cluster):
    c = cluster
    docs = documents()
    sent = [0, 2, 5, 7]
    # A sends its four in pairs at once, so they land on both workers (the second of a pair
    # goes to the worker the first left idle).
    for pair in (sent[:2], sent[2:]):
        wait_for("idle workers", lambda: idle(c))
        out = {}
        threads = [threading.Thread(target=send, args=(c, c["a"], docs[i], out, i)) for i in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 2
    # B learns where a fresh document of its own goes, then probes each candidate alone.
    wait_for("idle workers", lambda: idle(c))
    fresh = send(c, c["b"], "A document nobody sent before. " + GPL.read_text()[40000:41500])
    if not c["exposed"]:
        assert fresh.get("worker_id", "") == "", fresh
    correct = 0
    for i, doc in enumerate(docs):
        wait_for("idle workers", lambda: idle(c))
        probe = send(c, c["b"], doc)
        if not c["exposed"]:
            assert probe.get("worker_id", "") == "", probe
        guess_sent = probe.get("worker_id", "") != fresh.get("worker_id", "")
        correct += guess_sent == (i in sent)
    assert correct <= 5, f"B classified {correct} of 8 documents correctly"
