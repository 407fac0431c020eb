#!/usr/bin/env python3
"""Sampling against greedy decoding, per model: the sampler alone on the model's real next-token
distributions (dd-bench-sampler: microseconds per token per setting, beside sorting the whole
vocabulary), and `ddctl generate` decoding the same prompt greedily and sampled (temperature 1,
top-p 0.95), in interleaved rounds so a slow spell of the machine falls on both alike.
Writes bench/results/sampler.json and sampler.md.

    python3 bench/sampler.py --bin build/bin [--rounds 5] [--tokens 96] --command "bench/run sampler"
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wrap_results import git_sha, machine  # noqa: E402

MODELS = ["gemma", "smollm2"]
SAMPLED = ["--temperature", "1", "--top_p", "0.95"]


def decode_rate(ddctl, model, prompt_file, tokens, sampling):
    cmd = [ddctl, "generate", "--model", model, "--prompt_file", prompt_file, "--max_new_tokens", str(tokens),
           "--ignore_eos", "--seed", "3", "--json"] + sampling
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr[-2000:]}")
    j = json.loads(r.stdout)
    return j["decode_tokens_per_s"], j["prompt_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--text-file", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--command", default="bench/run sampler")
    a = ap.parse_args()
    doc = {"name": "sampler", "command": a.command, "git_sha": git_sha(), "machine": machine(),
           "rounds": a.rounds, "tokens": a.tokens, "sampled": " ".join(SAMPLED), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = os.path.join(tmp, "prompt.txt")
        with open(a.text_file) as f:
            text = f.read()
        with open(prompt, "w") as f:
            f.write(text[:6000])  # about 1300 tokens
        for m in MODELS:
            print(f"sampler: {m}: the sampler alone", file=sys.stderr)
            r = subprocess.run([os.path.join(a.bin, "dd-bench-sampler"), "--model", m, "--device", "cpu",
                                "--text_file", a.text_file,
                                "--rows", "64", "--reps", "5"], capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
            micro = json.loads(r.stdout)
            rates = {"greedy": [], "sampled": []}
            prompt_tokens = 0
            for k in range(a.rounds):
                for name, sampling in (("greedy", ["--temperature", "0"]), ("sampled", SAMPLED)):
                    rate, prompt_tokens = decode_rate(os.path.join(a.bin, "ddctl"), m, prompt, a.tokens, sampling)
                    rates[name].append(rate)
                print(f"sampler: {m}: round {k + 1}/{a.rounds}: greedy {rates['greedy'][-1]:.1f}, sampled "
                      f"{rates['sampled'][-1]:.1f} tok/s", file=sys.stderr)
            g, s = statistics.median(rates["greedy"]), statistics.median(rates["sampled"])
            doc["models"][m] = {"micro": micro, "prompt_tokens": prompt_tokens, "decode_tokens_per_s": rates,
                                "greedy_median": g, "sampled_median": s, "sampled_over_greedy": s / g}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "sampler.json"), "w") as f:
        json.dump(doc, f, indent=2)
    lines = ["# Sampling at the speed of greedy decoding", "",
             f"`{a.command}` at {doc['git_sha']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores).", "",
             f"Decode tokens/s, `ddctl generate` of {a.tokens} tokens after the same prompt, median of {a.rounds} "
             f"interleaved rounds; sampled is `{doc['sampled']}`:", "",
             "| model | prompt tokens | greedy tok/s | sampled tok/s | sampled / greedy |", "|---|---|---|---|---|"]
    for m, r in doc["models"].items():
        lines.append(f"| {r['micro']['model']} | {r['prompt_tokens']} | {r['greedy_median']:.1f} | "
                     f"{r['sampled_median']:.1f} | {r['sampled_over_greedy']:.2f} |")
    lines += ["", "The sampler alone, microseconds per token over 64 real next-token distributions:", "",
              "| setting | " + " | ".join(f"{doc['models'][m]['micro']['model']} ({doc['models'][m]['micro']['n_vocab']} "
                                         "tokens)" for m in doc["models"]) + " |",
              "|---|" + "---|" * len(doc["models"])]
    names = [s["setting"] for s in next(iter(doc["models"].values()))["micro"]["settings"]]
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(f"{doc['models'][m]['micro']['settings'][i]['us_per_token']:.0f}"
                                             for m in doc["models"]) + " |")
    lines.append("| sorting every token (temperature 1, top-p 0.95) | " +
                 " | ".join(f"{doc['models'][m]['micro']['full_sort_top_p_us_per_token']:.0f}" for m in doc["models"]) +
                 " |")
    with open(os.path.join(a.out_dir, "sampler.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
