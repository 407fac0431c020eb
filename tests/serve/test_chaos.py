"""The chaos test's quick preset (tests/serve/chaos.py): 45 s of four greedy streams while a
worker, the pool and the router are killed and restarted at random."""
import json

from chaos import run
from serving import require_model


def test_chaos_quick(tmp_path):
    require_model()
    stats = run(tmp_path, seconds=45, streams=4, n=32, seed=7)
    print(json.dumps(stats, indent=2))
    assert stats["faults"], "faults were injected"
    assert stats["completed"] >= 4, stats
    assert stats["wrong"] == 0 and stats["duplicated"] == 0, stats
    # Only a router restart may fail a stream, and then with the retryable UNAVAILABLE.
    for f in stats["failures"]:
        assert "UNAVAILABLE" in f, stats["failures"]
    router_faults = sum(1 for f in stats["faults"] if f["kind"] == "router")
    if router_faults == 0:
        assert stats["failed"] == 0, stats
