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
