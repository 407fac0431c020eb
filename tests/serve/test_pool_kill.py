"""The pool-kill preset (tests/serve/pool_kill.py): three runs in which the KV pool is SIGKILLed
mid-stream and restarted, decode attending sparsely; every stream must equal the undisturbed one
(before the rebuild replayed generated tokens as decode steps, it prefilled them densely and a
greedy stream could turn)."""
import json

from pool_kill import run
from serving import require_model


def test_every_stream_survives_a_pool_kill_unchanged(tmp_path):
    require_model()
    stats = run(tmp_path, runs=3, n=48, seed=3)
    print(json.dumps(stats, indent=2))
    assert stats["failed"] == 0, stats
    assert stats["rebuilt_runs"] >= 1, "no run rebuilt its KV (the pool's loss went unnoticed)"
    assert stats["identical"] == stats["runs"] == 3, stats
