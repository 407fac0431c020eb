"""Serving benchmark (docs/benchmarks.md, "serve and serve-full"): the embedded server (`ddctl
serve`: router + worker + in-process pool) under open-loop Poisson load with long prompts, `full` vs
`dualdecoder` at the same device-memory budget. Writes the raw results for wrap_results.py
(serve.json, .md, .png).

Usage: serve.py --bin build/bin --model M.gguf --preset quick|full --raw OUT.json
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

# The budgets include Gemma 3 270M's forward workspace (82 MiB), which the memory plan counts
# since 2026-12-06: 400 and 450 MiB before, the same room for KV.
PRESETS = {
    # ~2K-token prompts; 2 cores prefill one in ~4 s and serve ~0.25 req/s in all, so the
    # rates go from light load to overload.
    "quick": {"prompt_chars": 9000, "rates": [0.05, 0.1, 0.2], "requests": 5, "max_new_tokens": 24,
              "device_memory": "482MiB"},
    # ~8K-token prompts under a budget where full KV fits ~2 requests and dualdecoder ~5.
    "full": {"prompt_chars": 36000, "rates": [0.02, 0.04, 0.08], "requests": 8, "max_new_tokens": 64,
             "device_memory": "532MiB"},
}
HAYSTACK = Path("/usr/share/common-licenses")


def long_text(chars):
    """Natural English from the Debian license texts (the eval haystack), `chars` long."""
    text = ""
    for name in ("GPL-3", "GPL-2", "LGPL-3", "Apache-2.0", "MPL-2.0", "Artistic"):
        p = HAYSTACK / name
        if p.is_file():
            text += p.read_text(errors="replace") + "\n"
        if len(text) >= chars:
            break
    if len(text) < chars:
        sys.exit(f"serve.py: not enough text under {HAYSTACK} for {chars} characters")
    return text[:chars]


def memory(bin_dir, model, mode, prompt_file, budget):
    """Per-request device-memory figures of the engine's plan for this prompt."""
    r = subprocess.run([str(bin_dir / "ddctl"), "generate", "--model", model, "--mode", mode, "--prompt_file",
                        prompt_file, "--max_new_tokens", "1", "--json", "--budget", "512", "--device_memory", budget],
                       capture_output=True, text=True, check=True)
    j = json.loads(r.stdout)
    return {"prompt_tokens": j["prompt_tokens"], **j["device_memory"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--preset", choices=PRESETS, default="quick")
    ap.add_argument("--raw", required=True)
    a = ap.parse_args()
    cfg = PRESETS[a.preset]
    prompt_file = Path(a.raw).with_suffix(".prompt.txt")
    prompt_file.write_text(long_text(cfg["prompt_chars"]))
    out = {"config": {**cfg, "modes": ["full", "dualdecoder"], "sparse_budget_tokens": 512,
                      "server": "ddctl serve (router + 1 worker + in-process pool), 2 threads"},
           "modes": {}, "memory": {}}
    for mode in ("full", "dualdecoder"):
        out["memory"][mode] = memory(a.bin, a.model, mode, str(prompt_file), cfg["device_memory"])
        print(f"bench serve: {mode}: starting ddctl serve", file=sys.stderr, flush=True)
        server = subprocess.Popen([str(a.bin / "ddctl"), "serve", "--model", a.model, "--mode", mode, "--budget", "512",
                                   "--device_memory", cfg["device_memory"], "--max_batch", "16", "--max_waiting", "64",
                                   "--metrics_listen", ""], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True)
        try:
            line = server.stdout.readline()
            if "listening on" not in line:
                sys.exit(f"bench serve: ddctl serve did not start: {line!r}")
            words = line.split()
            addr = words[words.index("on") + 1]
            raw = Path(a.raw).with_suffix(f".{mode}.json")
            subprocess.run([str(a.bin / "dd-bench-serve"), "--server", addr, "--prompt_file", str(prompt_file),
                            "--rates", ",".join(str(r) for r in cfg["rates"]), "--requests", str(cfg["requests"]),
                            "--max_new_tokens", str(cfg["max_new_tokens"]), "--label", mode, "--out", str(raw)],
                           check=True)
            out["modes"][mode] = json.loads(raw.read_text())
            raw.unlink()
        finally:
            server.terminate()
            server.wait(timeout=60)
    prompt_file.unlink()
    Path(a.raw).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
