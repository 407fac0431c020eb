#!/usr/bin/env python3
"""TTFT saved by prefix reuse (docs/architecture.md, "Prefix reuse"): a real dd-kv-pool, real ddctl
processes on the real model. Request A (a long document + question 1) commits its prefix;
request B (the same document + question 2, as from another worker process) is then timed
with and without prefix reuse, alternating, in the same run. Writes
bench/results/prefix-reuse.{json,md}."""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
import haystack  # noqa: E402
import models  # noqa: E402

TOKEN = "prefix-bench-token-0123456789"


def git_sha():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", help="model file or short name gemma|smollm2 (default $DD_MODEL, else gemma)")
    ap.add_argument("--text", default=haystack.license_path("GPL-3"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--mode", default="dualdecoder")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    a.model = str(models.model_path(a.model))
    for exe in ("ddctl", "dd-kv-pool"):
        if not (Path(a.bin) / exe).is_file():
            sys.exit(f"prefix_ttft: {exe} not built in {a.bin}: run scripts/build")
    if not Path(a.model).is_file():
        sys.exit(f"prefix_ttft: model missing at {a.model}: run scripts/fetch-model")
    doc = Path(a.text).read_text()
    prompts = {q: f"{doc}\n\nQuestion: {q}\nAnswer:" for q in
               ("What is the name of this license?", "Who may copy and distribute the Program?")}
    qa, qb = prompts
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "tenants.json"
        cfg.write_text(json.dumps([{"name": "bench", "token": TOKEN, "quota": "4GiB"}]))
        cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
        pool = subprocess.Popen([str(Path(a.bin) / "dd-kv-pool"), f"--tenants={cfg}"], stdout=subprocess.PIPE, text=True)
        try:
            line = pool.stdout.readline()
            if "listening on" not in line:
                sys.exit(f"prefix_ttft: dd-kv-pool did not start: {line!r}")
            addr = line.split()[3]
            env = dict(os.environ, DD_KV_POOL_TOKEN=TOKEN)

            def run(question, reuse):
                pf = Path(tmp) / "prompt.txt"
                pf.write_text(prompts[question])
                r = subprocess.run([str(Path(a.bin) / "ddctl"), "generate", "--model", a.model, "--prompt_file", str(pf),
                                    "--mode", a.mode, "--max_new_tokens", "12", "--json", "--kv_store", f"shm://{addr}",
                                    "--prefix_block", str(a.block if reuse else 0)],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    sys.exit(f"prefix_ttft: ddctl failed: {r.stderr}")
                j = json.loads(r.stdout)
                print(f"prefix_ttft: {'reuse' if reuse else 'cold '} prompt {j['prompt_tokens']} tokens, reused "
                      f"{j['prefix_reused_tokens']}, TTFT {j['ttft_s']:.2f} s", file=sys.stderr)
                return j

            first = run(qa, True)  # commits the document's blocks
            rounds = []
            for _ in range(a.rounds):
                cold, warm = run(qb, False), run(qb, True)
                rounds.append({"cold_ttft_s": cold["ttft_s"], "reuse_ttft_s": warm["ttft_s"],
                               "reused_tokens": warm["prefix_reused_tokens"], "prompt_tokens": warm["prompt_tokens"],
                               "same_tokens": cold["tokens"] == warm["tokens"]})
        finally:
            pool.terminate()
            pool.wait(timeout=30)
    cold = sorted(r["cold_ttft_s"] for r in rounds)[len(rounds) // 2]
    warm = sorted(r["reuse_ttft_s"] for r in rounds)[len(rounds) // 2]
    result = {"benchmark": "prefix-reuse", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "git_sha": git_sha(), "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "mode": a.mode, "block_tokens": a.block, "first_request_ttft_s": first["ttft_s"], "rounds": rounds,
              "cold_ttft_s_median": cold, "reuse_ttft_s_median": warm, "speedup": cold / warm if warm else None}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-reuse.json").write_text(json.dumps(result, indent=2) + "\n")
    r0 = rounds[0]
    md = [f"# Prefix reuse: TTFT ({a.mode}, {a.block}-token blocks)", "",
          f"git {result['git_sha'][:12]}, {result['date']}, {result['machine']['cores']} cores. One dd-kv-pool (shm://); "
          f"request A (document + question 1) commits its prefix; request B (same document + question 2, a new "
          f"ddctl process) is timed with and without reuse, alternating, {a.rounds} rounds.", "",
          "| round | prompt tokens | reused tokens | TTFT cold (s) | TTFT with reuse (s) | same tokens |",
          "|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rounds):
        md.append(f"| {i} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['cold_ttft_s']:.2f} | "
                  f"{r['reuse_ttft_s']:.2f} | {r['same_tokens']} |")
    md += ["", f"Median TTFT {cold:.2f} s cold vs {warm:.2f} s with reuse: {cold / warm:.1f}× faster "
           f"({r0['reused_tokens']} of {r0['prompt_tokens']} prompt tokens restored from the pool).", ""]
    (out / "prefix-reuse.md").write_text("\n".join(md))
    print(f"prefix_ttft: wrote {out / 'prefix-reuse.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
