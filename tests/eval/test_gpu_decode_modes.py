"""bench/gpu_decode_modes.py, the paper-shape benchmark, end to end on the CPU (its cpu-smoke
preset: a small synthetic shape, the real dd-bench-modes and dd-kv-pool): every mode on every
store under each stated hit rate, the engine's measured hit rate the model's, the tables and
targets written; host memory bounds the batches."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("DD_BIN_DIR", REPO / "build" / "bin"))
sys.path.insert(0, str(REPO / "bench"))
import gpu_decode_modes  # noqa: E402


def run(tmp_path, *args):
    return subprocess.run([sys.executable, str(REPO / "bench" / "gpu_decode_modes.py"), "--bin", str(BIN),
                           "--out-dir", str(tmp_path), "--device", "cpu", "--git-sha", "test", *args],
                          capture_output=True, text=True, timeout=600)


def test_cpu_smoke_runs_every_mode_store_and_hit_rate(tmp_path):
    r = run(tmp_path, "--preset", "cpu-smoke")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-decode-modes.json").read_text())
    (res,) = doc["results"]
    assert "error" not in res, res.get("error")
    runs = res["raw"]["runs"]
    assert res["raw"]["synthetic_kv"] is True
    budget_chunks = doc["budget"] // 8
    seen = set()
    for x in runs:
        seen.add((x["mode"], x["link"], x["batch"]))
        if x["mode"] == "full":
            assert x["selection_model"] == "off"
            continue
        hit = float(x["selection_model"].split(":")[1])
        if x["mode"] == "dualdecoder" and not gpu_decode_modes.is_reference(x["selection_model"]):
            # The engine's own counter reads the stated rate (k chunks per head: a multiple of 1/k).
            assert x["hit_rate"] == pytest.approx(round(hit * budget_chunks) / budget_chunks, abs=1e-9)
    for mode in ("sparse", "sparse-cached", "dualdecoder"):
        for link in ("inmem", "shm"):
            for batch in (1, 2):
                assert (mode, link, batch) in seen
    # Each sparse mode once per hit rate and the infinite-link reference (1:1, nothing moved after
    # the first step); full once.
    assert sum(1 for x in runs if x["mode"] == "full") == 2
    assert sum(1 for x in runs if x["mode"] == "dualdecoder") == 3 * 2 * 2
    for x in runs:
        if x["mode"] in ("sparse-cached", "dualdecoder") and gpu_decode_modes.is_reference(x["selection_model"]):
            assert x["urgent_bytes_per_step"] == 0 and x["prefetch_bytes_per_step"] == 0, x
            if x["mode"] == "dualdecoder":
                assert x["hit_rate"] == 1.0
    md = (tmp_path / "gpu-decode-modes.md").read_text()
    assert "| inmem | 0.95 | 1 |" in md and "| shm | 0.7 | 2 |" in md and "| inmem | ∞ | 1 |" in md
    assert "dualdecoder ≥ 1.5× sparse-cached" in md
    assert doc["targets"]["dual_over_cached"], "no run decided the target"
    assert doc["targets"]["dual_of_infinite"], "no infinite-link figure"


def test_batches_beyond_host_memory_are_reported_not_run():
    assert gpu_decode_modes.fitting_batches("1,8,max", 3) == (["1", "max"], [8])
    assert gpu_decode_modes.fitting_batches("1,2", 5) == (["1", "2"], [])
    # The 8B shape's 128K-token request: 34 GB of float32 KV on the host.
    assert gpu_decode_modes.host_kv_bytes("llama-3.1-8b", 131072) == 32 * 8 * 128 * 2 * 4 * 131072


def test_a_hit_rate_outside_zero_to_one_is_refused(tmp_path):
    r = run(tmp_path, "--preset", "cpu-smoke", "--hits", "0.9,1.2")
    assert r.returncode != 0
    assert "1.2 is not a fraction" in r.stderr
