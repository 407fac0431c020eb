"""Key reconstruction through `ddctl serve` (docs/decisions/0052-low-rank-key-reconstruction.md):
with `--key_reconstruction all` a request's usage says how many chunks had their keys rebuilt,
the key bytes that did not move and the device bytes of its landmarks and low-rank key caches,
and the worker's metrics count the same; with it off those stay zero."""
from pathlib import Path
import urllib.request

from serving import Proc, ddctl_json, metric, require_model

GPL = Path("/usr/share/common-licenses/GPL-3")


def serve(d, *flags):
    require_model()
    return Proc("serve", ["ddctl", "serve", "--model=smollm2", "--mode=dualdecoder", "--budget=64", "--threads=2",
                          "--prefix_block=0", *flags], d)


def run(tmp_path, *flags):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(GPL.read_text()[:4000])  # about 900 tokens: 100 chunks, 8 selected
    p = serve(tmp_path, *flags)
    try:
        out = ddctl_json("generate", "--server", p.addr, "--prompt_file", str(prompt), "--max_new_tokens", "12",
                         "--ignore_eos")
        with urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=10) as r:
            page = r.read().decode()
        return out["usage"], page, metric(p.metrics, "dd_kv_key_bytes_saved_total")
    finally:
        p.stop()


def test_usage_and_metrics_report_rebuilt_keys(tmp_path):
    u, page, saved = run(tmp_path, "--key_reconstruction=all")
    assert int(u["kv_reconstructed_chunks"]) > 0, u
    assert int(u["kv_key_bytes_saved"]) > 0, u
    assert int(u["landmark_device_bytes"]) > 0 and int(u["low_rank_key_device_bytes"]) > 0, u
    assert saved is not None and saved >= int(u["kv_key_bytes_saved"]), (saved, u)
    assert 'event="reconstructed"' in page and 'event="values_only"' in page
    assert metric_value(page, "dd_key_reconstructing_layers") == 30  # every SmolLM2 layer is sparse


def test_off_rebuilds_nothing_and_keeps_no_low_rank_cache(tmp_path):
    u, _, saved = run(tmp_path)
    assert int(u.get("kv_reconstructed_chunks", 0)) == 0, u
    assert int(u.get("kv_key_bytes_saved", 0)) == 0, u
    assert int(u.get("low_rank_key_device_bytes", 0)) == 0 and int(u["landmark_device_bytes"]) > 0, u
    assert saved == 0


def metric_value(page, name):
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics page")
