"""A real Prometheus (Debian's `prometheus`) scraping a real cluster on loopback
(docs/decisions/0029-operations-surface.md): after a short load, every Grafana panel's expression
(deploy/monitoring/gen.py) and every recording rule (deploy/monitoring/rules.yml) must return data
through Prometheus' HTTP API. A panel that shows nothing is a failing test."""
import json
import math
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from serving import ddctl_json, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "monitoring"))
import gen  # noqa: E402


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as f:
        body = json.loads(f.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def has_data(result):
    """At least one finite sample (an empty vector or only NaN shows nothing on a panel)."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


@pytest.fixture
def prometheus(cluster, tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("prometheus is missing (scripts/install-deps installs it)", pytrace=False)
    rules = yaml.safe_load((ROOT / "deploy/monitoring/rules.yml").read_text())
    for g in rules["groups"]:
        g.pop("interval", None)  # evaluate every second here, not every 30 s
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    targets = [cluster["router"].metrics, cluster["pool"].metrics] + [w.metrics for w in cluster["workers"].values()]
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(tmp_path / "rules.yml")],
           "scrape_configs": [{"job_name": "dualdecoder", "static_configs": [{"targets": targets}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    p = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        def all_up():
            try:
                return len([r for r in query(base, "up == 1")]) == len(targets)
            except OSError:
                return False
        wait_for("Prometheus scraping every target", all_up, timeout=60)
        yield base
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_every_panel_and_recording_rule_returns_data(cluster, prometheus):
    router = cluster["router"].addr
    text = "The harbour log, day {}: " + "ships came in with salt and timber, and the keeper wrote it down. " * 60

    def one(i):
        return ddctl_json("generate", "--server", router, "--prompt", text.format(i), "--max_new_tokens", "12",
                          "--ignore_eos")

    with ThreadPoolExecutor(3) as ex:
        list(ex.map(one, range(6)))
    exprs = [(title, e.replace("$__rate_interval", "1m")) for title, e in gen.expressions()]
    exprs += [(f"recording rule {r['record']}", r["record"])
              for g in yaml.safe_load((ROOT / "deploy/monitoring/rules.yml").read_text())["groups"]
              for r in g["rules"] if "record" in r]
    deadline = time.monotonic() + 90
    empty = exprs
    while empty and time.monotonic() < deadline:
        empty = [(t, e) for t, e in empty if not has_data(query(prometheus, e))]
        if empty:
            time.sleep(1)
    assert not empty, "panels or rules with no data:\n" + "\n".join(f"  {t}: {e}" for t, e in empty)
