"""The start-up device check, end to end on the real Gemma 3 270M with the sim device standing for
a GPU: `ddctl device-check` prints the comparison and passes; a deliberately wrong decode-attention
op ($DD_SIM_FAULT, test-only) fails it; then `--device auto` falls back to the cpu and says why (on
stderr and in /metrics), and an explicitly named device is refused unless the operator accepts the
risk by name."""
import json
import os
import subprocess
import urllib.request

from serving import BIN, Proc, require_model

FAULT = {"DD_SIM_FAULT": "decode_attention_off_by_one"}


def run(*args, env=None):
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def scrape(proc):
    with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=10) as r:
        return r.read().decode()


def test_ddctl_device_check_prints_the_comparison_and_fails_on_a_wrong_op():
    model = require_model()
    ok = run("ddctl", "device-check", f"--model={model}", "--device=sim", "--mode=dualdecoder", "--threads=2")
    assert ok.returncode == 0, ok.stderr
    assert "device check passed: sim against cpu, dualdecoder mode, 34 logit rows" in ok.stdout, ok.stdout
    assert "tokens 34/34 equal" in ok.stdout and " FAIL" not in ok.stdout, ok.stdout
    bad = run("ddctl", "device-check", f"--model={model}", "--device=sim", "--threads=2", "--json", env=FAULT)
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert report["passed"] is False and report["device"] == "sim" and report["mode"] == "full", report["reason"]
    # Prefill is right and decode is wrong, so the verdict names the first decode step.
    assert all(r["ok"] for r in report["rows"] if r["step"] == 0), report["rows"]
    assert report["reason"].startswith("sequence 0, decode step 1: logits differ"), report["reason"]
    assert "the device check of sim failed" in bad.stderr, bad.stderr


def test_auto_falls_back_to_the_cpu_when_its_candidate_fails(tmp_path):
    model = require_model()
    env = dict(os.environ, DD_AUTO_DEVICE_CANDIDATE="sim", **FAULT)
    worker = Proc("auto", ["dd-decode-worker", f"--model={model}", "--threads=2"], tmp_path, env=env)
    try:
        log = worker.log.read_text()
        assert "device check FAILED: sim against cpu" in log, log
        assert "compute device cpu (auto: sim failed its start-up check, so the cpu serves" in log, log
        metrics = scrape(worker)
        assert 'dd_device_check_passed{device="sim",serving_on="cpu"} 0' in metrics, metrics
        assert "dd_device_check_seconds " in metrics, metrics
    finally:
        worker.stop()


def test_a_named_device_that_fails_is_refused_unless_the_risk_is_accepted(tmp_path):
    model = require_model()
    env = dict(os.environ, **FAULT)
    refused = run("dd-decode-worker", f"--model={model}", "--device=sim", "--threads=2", env=FAULT)
    assert refused.returncode == 1, refused.stderr
    assert "--device sim failed its start-up check against the cpu, so it will not serve" in refused.stderr
    assert "--allow_incorrect_device serves on it anyway" in refused.stderr, refused.stderr
    worker = Proc("allowed", ["dd-decode-worker", f"--model={model}", "--device=sim", "--threads=2",
                              "--allow_incorrect_device"], tmp_path, env=env)
    try:
        log = worker.log.read_text()
        assert "compute device sim (requested; it FAILED its start-up check" in log, log
        assert 'dd_device_check_passed{device="sim",serving_on="sim"} 0' in scrape(worker)
    finally:
        worker.stop()
