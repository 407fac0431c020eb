"""Tests for the benchmark drivers' argument handling and what they record (bench/)."""
import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import compare_llamacpp  # noqa: E402
import compare_prefill  # noqa: E402


def test_lengths_default_per_model_and_override_one():
    got = compare_prefill.parse_lengths(["gemma=1024,32000"], ["gemma", "smollm2"])
    assert got["gemma"] == [1024, 32000]
    assert got["smollm2"] == compare_prefill.DEFAULT_LENGTHS["smollm2"]
    # Gemma's context is 32768 tokens: the default must leave room for one generated token.
    assert max(compare_prefill.DEFAULT_LENGTHS["gemma"]) < 32768


@pytest.mark.parametrize("spec, words", [
    ("llama=1024", "one of gemma"),      # a model not in the run
    ("gemma=", "MODEL=N"),               # no lengths
    ("gemma=1k,2048", "not a list of integers"),
    ("gemma=8,1024", ">= 16"),
])
def test_bad_lengths_name_the_problem(spec, words):
    with pytest.raises(SystemExit) as e:
        compare_prefill.parse_lengths([spec], ["gemma"])
    assert words in str(e.value)


def test_record_keeps_what_bench_run_passed(monkeypatch):
    ap = argparse.ArgumentParser()
    compare_llamacpp.add_record_args(ap)
    monkeypatch.setattr(sys, "argv", ["compare_prefill.py", "--rounds", "2"])
    rec = compare_llamacpp.record(ap.parse_args(["--preset", "full", "--command", "bench/run prefill --full"]),
                                  "bench/compare_prefill.py")
    assert rec == {"command": "bench/run prefill --full", "preset": "full", "script_args": ["--rounds", "2"]}
    # Run by hand: the script's own command line.
    rec = compare_llamacpp.record(ap.parse_args([]), "bench/compare_prefill.py")
    assert rec["command"] == "bench/compare_prefill.py --rounds 2" and rec["preset"] == ""


def test_summarize_rewrites_only_the_summary(tmp_path):
    """wrap_results --summarize: a results file's markdown comes again from what the JSON records
    (same commit and figures); the pool table names the dualdecoder that ran on the pool."""
    import json
    import shutil
    import subprocess
    src = REPO / "bench" / "results" / "decode-modes-smollm2.json"
    res = tmp_path / "decode-modes-smollm2.json"
    shutil.copy(src, res)
    before = res.read_bytes()
    doc = json.loads(before)
    subprocess.run([sys.executable, str(REPO / "bench" / "wrap_results.py"), "--summarize", str(res)], check=True,
                   capture_output=True)
    assert res.read_bytes() == before
    md = (tmp_path / "decode-modes-smollm2.md").read_text()
    assert doc["git_sha"][:12] in md
    pool_duals = {r["mode"] for r in doc["results"]["runs"]
                  if r["link"].startswith("ucx") and r["mode"].startswith("dualdecoder")}
    assert pool_duals, "the results file has no pool run to summarize"
    assert f"KV in a real dd-kv-pool: `{sorted(pool_duals)[0]}`" in md
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "wrap_results.py"), "--summarize",
                          str(REPO / "README.md")], capture_output=True, text=True)
    assert bad.returncode != 0 and "cannot read" in bad.stderr
    # A results file of a benchmark this script does not summarize is refused, and its
    # existing summary is left as it was.
    other = tmp_path / "eval-tasks.json"
    other.write_text(json.dumps({"benchmark": "eval-tasks", "results": {}}))
    (tmp_path / "eval-tasks.md").write_text("kept\n")
    refused = subprocess.run([sys.executable, str(REPO / "bench" / "wrap_results.py"), "--summarize", str(other)],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "no summary for benchmark 'eval-tasks'" in refused.stderr
    assert (tmp_path / "eval-tasks.md").read_text() == "kept\n"


def test_pool_summary_takes_ratios_within_rounds(tmp_path):
    """A pool results file measured in rounds: the table gives each row's median over the rounds,
    and 'vs memcpy' the median of each round's ratio to that round's memcpy, with its range."""
    import json
    import subprocess
    def row(t, rnd, gbps):
        return {"transport": t, "round": rnd, "blocks_per_gather": 64, "concurrency": 1, "block_bytes": 16384,
                "gbps": gbps, "latency_ms_p50": 1.0 / gbps, "latency_ms_p99": 2.0 / gbps, "gathers": 10,
                "gatherer_cpu_cores": 1.0, "pool_cpu_cores": None if t == "memcpy" else 0.5}
    # The host is twice as fast in round 1: the pooled ratio of medians (5/15) would hide that
    # ucx-sm moved half of memcpy's bytes in each round.
    runs = [row("memcpy", 0, 10.0), row("ucx-sm", 0, 5.0), row("ucx-sm", 1, 10.0), row("memcpy", 1, 20.0),
            row("memcpy", 2, 12.0), row("ucx-sm", 2, 3.0)]
    ceiling = [{"tool": "ucx_perftest tag_bw", "ucx_tls": "sm,self", "message_bytes": 1 << 20,
                "blocks_per_gather": 64, "gbps": 10.0, "gbps_runs": [9.0, 10.0, 11.0]},
               {"tool": "ucx_perftest tag_lat", "ucx_tls": "sm,self", "message_bytes": 1 << 20,
                "blocks_per_gather": 64, "gbps": 4.0, "gbps_runs": [4.0, 4.0, 4.0]}]
    doc = {"benchmark": "pool", "preset": "quick", "git_sha": "0" * 40, "date": "2026-12-04",
           "machine": {"cpu": "test cpu", "cores": 2},
           "results": {"runs": runs, "ucx_ceiling": ceiling, "block_bytes": 16384, "chunks_per_gatherer": 2048}}
    def summarize():
        res = tmp_path / "pool.json"
        res.write_text(json.dumps(doc))
        subprocess.run([sys.executable, str(REPO / "bench" / "wrap_results.py"), "--summarize", str(res)],
                       check=True, capture_output=True)
        return (tmp_path / "pool.md").read_text()
    md = summarize()
    assert "measured in 3 rounds" in md
    # memcpy median 12.00; ucx-sm median 5.00, ratios 50% / 50% / 25%, vs tag_bw 50%, vs ping-pong 125%.
    assert "| memcpy | 64 | 1 | 12.00 | 100% (100%–100%) |" in md
    assert "| ucx-sm | 64 | 1 | 5.00 | 50% (25%–50%) | 50% | 125% | 0.200 | 0.400 | 1.00 | 0.50 |" in md
    assert "ucx_perftest tag_lat (GB/s, median; every run in order): sm 1024 KiB 4.00 (4.00, 4.00, 4.00)" in md
    # Since 3c8f45a (2026-12-04) perftest runs in every round: each row is judged against its own round's figure.
    doc["results"]["ucx_ceiling"] = [dict(c, round=k, gbps=g, gbps_runs=[g])
                                     for c, per_round in zip(ceiling, ([10.0, 20.0, 6.0], [4.0, 8.0, 3.0]))
                                     for k, g in enumerate(per_round)]
    md = summarize()
    # ucx-sm 5/10, 10/20, 3/6 of tag_bw; 5/4, 10/8, 3/3 of tag_lat.
    assert "| ucx-sm | 64 | 1 | 5.00 | 50% (25%–50%) | 50% (50%–50%) | 125% (100%–125%) |" in md
    assert "ucx_perftest tag_bw (GB/s, median; every run in order, one per round): sm 1024 KiB 10.00 (10.00, 20.00, 6.00)" in md
