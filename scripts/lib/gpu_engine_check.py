#!/usr/bin/env python3
"""The engine on the CUDA device, end to end, on models a bare GPU machine has: the project's
tiny synthetic models (tests/reference/make_synthetic.py, carried in .gpu-bundle/models).

For each model, greedy `ddctl generate` over a prompt long enough that chunk selection matters
(budget 16 tokens of ~90 selectable chunks), in every mode on `cuda` and `full` on `cpu`:
  - sparse, sparse-cached and dualdecoder give the same tokens (real rows are bit-identical
    across them; the slow-link case is logits_hash_test's, which needs the real models);
  - full on cuda gives the cpu's tokens, or the first step where they part is reported (random
    weights make near-ties likelier than a trained model does).
Writes a JSON summary (tokens/s per mode, the checks) to --out; exit status 1 when a check fails.

    gpu_engine_check.py --ddctl BIN --models DIR --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

MODES = ["full", "sparse", "sparse-cached", "dualdecoder"]


def generate(ddctl: str, model: str, prompt_file: str, device: str, mode: str, extra: list[str]) -> dict:
    cmd = [ddctl, "generate", "--model", model, "--prompt_file", prompt_file, "--raw_prompt", "--device", device,
           "--mode", mode, "--budget", "16", "--max_new_tokens", "48", "--temperature", "0", "--ignore_eos",
           "--json"] + extra
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout)


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddctl", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    words = "the river flows past the mill and the keeper counts each ship that passes the light".split()
    summary: dict = {"models": {}, "failures": []}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = f"{tmp}/prompt.txt"
        with open(prompt, "w") as f:
            f.write(" ".join(f"{words[i % len(words)]} {i}" for i in range(150)))
        check_models(args, prompt, summary)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    for line in summary["failures"]:
        print(f"gpu_engine_check: {line}", file=sys.stderr)
    print(json.dumps(summary["models"], indent=1, sort_keys=True), file=sys.stderr)
    return 1 if summary["failures"] else 0


def check_models(args: argparse.Namespace, prompt: str, summary: dict) -> None:
    for name in ["tiny-llama", "tiny-qwen2"]:
        model = f"{args.models}/{name}.gguf"
        runs = {}
        try:
            for mode in MODES:
                runs[f"{mode}@cuda"] = generate(args.ddctl, model, prompt, "cuda", mode, [])
            runs["full@cpu"] = generate(args.ddctl, model, prompt, "cpu", "full", [])
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            summary["failures"].append(f"{name}: {e}")
            continue
        tokens = {k: v["tokens"] for k, v in runs.items()}
        checks = {}
        for other in ["sparse-cached@cuda", "dualdecoder@cuda"]:
            d = first_difference(tokens["sparse@cuda"], tokens[other])
            checks[f"{other} == sparse@cuda"] = d == -1
            if d != -1:
                summary["failures"].append(f"{name}: {other} leaves sparse@cuda at token {d}")
        d = first_difference(tokens["full@cuda"], tokens["full@cpu"])
        checks["full@cuda == full@cpu"] = d == -1
        if d != -1:
            summary["failures"].append(f"{name}: full@cuda leaves full@cpu at token {d} (check for a near-tie)")
        summary["models"][name] = {
            "checks": checks,
            "decode_tokens_per_s": {k: v["decode_tokens_per_s"] for k, v in runs.items()},
            "hit_rate": runs["dualdecoder@cuda"].get("hit_rate", 0.0),
            "fetched_chunks": {k: v.get("fetched_chunks", 0) for k, v in runs.items()},
        }


if __name__ == "__main__":
    sys.exit(main())
