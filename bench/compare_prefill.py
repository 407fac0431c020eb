"""Prefill against llama.cpp on the same GGUF files, side by side in one run
(docs/benchmarks.md, "prefill-vs-llamacpp").

llama.cpp: llama-batched-bench from the tree bench/build-llamacpp pins, like for like with
DualDecoder's full mode (flash attention on, sliding-window layers keep only their window, same
threads, 512-token micro-batches as DualDecoder's prefill chunks), one prompt per length.
DualDecoder: dd-bench-model, one process per length, so each length's peak resident set is its
own; the engine's KV bytes and its memory plan's projection at the end of the prefill are
recorded beside it. Each round runs llama.cpp, then DualDecoder; each speed is the best of
the rounds (peak RSS the largest).

  bench/compare_prefill.py [--models gemma,smollm2] [--lengths gemma=1024,8192,32000 ...]
                           [--threads 2] [--rounds 1]
Writes bench/results/prefill-vs-llamacpp.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import compare_llamacpp as cl
from compare_llamacpp import REPO, models, wrap_results

# A prompt must leave room for one generated token: Gemma's context is 32768 tokens (32000
# is where the decode benchmarks measure it), SmolLM2's 8192 (8000).
DEFAULT_LENGTHS = {"gemma": [1024, 8192, 16384, 32000], "smollm2": [1024, 4096, 8000]}


def ours_run(model, length, threads):
    """One dd-bench-model process; its own peak RSS comes from wait4."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f, tempfile.TemporaryFile(mode="w+") as err:
        cmd = [str(REPO / "build" / "bin" / "dd-bench-model"), "--model", model, "--device", "cpu",
               "--prefill", str(length),
               "--contexts=", "--decode_steps", "1", "--threads", str(threads), "--out", f.name]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code  # reaped here; keep Popen from waiting again
        if code != 0:
            err.seek(0)
            sys.exit(f"compare_prefill: {' '.join(cmd)} failed ({code}):\n{err.read()[-2000:]}")
        with open(f.name) as fh:
            out = json.load(fh)["prefill"][0]
        out["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
        print(f"compare_prefill: dualdecoder {length} tokens: {out['tokens_per_s']:.1f} tok/s, "
              f"peak RSS {out['peak_rss_mib']:.0f} MiB ({time.time() - t0:.0f} s)", file=sys.stderr)
        out["command"] = cmd
        return out


def parse_lengths(specs, names):
    lengths = {n: DEFAULT_LENGTHS.get(n, [1024, 8192]) for n in names}
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in lengths or not values:
            sys.exit(f"compare_prefill: --lengths wants MODEL=N,N,... for one of {', '.join(names)}; got {spec!r}")
        try:
            lengths[name] = [int(v) for v in values.split(",")]
        except ValueError:
            sys.exit(f"compare_prefill: not a list of integers in {spec!r}")
        if min(lengths[name]) < 16:
            sys.exit(f"compare_prefill: prompt lengths must be >= 16 (got {spec!r})")
    return lengths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma,smollm2", help="short names, comma-separated")
    ap.add_argument("--lengths", nargs="*", default=[], help="MODEL=N,N,... (defaults: %s)" % DEFAULT_LENGTHS)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=1)
    cl.add_record_args(ap)
    a = ap.parse_args()
    if a.rounds < 1 or a.threads < 1:
        sys.exit("compare_prefill: rounds and threads must be >= 1")
    if not (REPO / "build" / "bin" / "dd-bench-model").exists():
        sys.exit("compare_prefill: build/bin/dd-bench-model is missing (run scripts/build)")
    names = a.models.split(",")
    lengths = parse_lengths(a.lengths, names)
    binary = cl.llamacpp_bin()
    per_model = []
    for name in names:
        path = str(models.model_path(name))
        runs = []
        for rnd in range(a.rounds):
            theirs = cl.llamacpp_run(binary, path, lengths[name], [1], 1, a.threads, cl.CONFIGS["like-for-like"])
            ours = [ours_run(path, n, a.threads) for n in lengths[name]]
            runs.append({"round": rnd, "llama_cpp": theirs, "dualdecoder": ours})
        rows = []
        for n in lengths[name]:
            mine = [r2 for r in runs for r2 in r["dualdecoder"] if r2["prompt_tokens"] == n]
            top = max(mine, key=lambda r2: r2["tokens_per_s"])
            theirs = max(r2["tokens_per_s"] for r in runs for r2 in r["llama_cpp"]["prefill"]
                         if r2["prompt_tokens"] == n)
            rows.append({"prompt_tokens": n, "dualdecoder_tokens_per_s": top["tokens_per_s"],
                         "llama_cpp_tokens_per_s": theirs, "ratio": top["tokens_per_s"] / theirs,
                         "peak_rss_mib": max(r2["peak_rss_mib"] for r2 in mine), "kv_mib": top["kv_mib"],
                         "projected_device_mib": top["projected_device_mib"]})
        per_model.append({"model": name, "path": path, "prefill": rows, "runs": runs})
    doc = {"benchmark": "prefill-vs-llamacpp", "git_sha": wrap_results.git_sha(), "machine": wrap_results.machine(),
           **cl.record(a, "bench/compare_prefill.py"), "threads": a.threads,
           "rounds": a.rounds, "llamacpp_source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp (bench/build-llamacpp)",
           "llamacpp_config": cl.CONFIGS["like-for-like"], "models": per_model}
    md = ["# Prefill: DualDecoder vs llama.cpp, same GGUF, one run", "",
          f"{doc['machine']['cpu']}, {a.threads} threads, git {doc['git_sha'][:12]}, best of {a.rounds} "
          f"alternating round(s); `{doc['command']}`", "",
          "llama.cpp: `llama-batched-bench -fa on -ub 512` (windowed sliding-window cache). DualDecoder: full mode, "
          "512-token chunks, one process per length. Peak RSS includes the mmapped model; projected = the engine's "
          "memory plan (weights + KV + per-row workspace + prefill extra) for that prompt.", "",
          "| model | prompt tokens | DualDecoder tok/s | llama.cpp tok/s | ratio | peak RSS MiB | KV MiB | "
          "projected MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in per_model:
        for r in m["prefill"]:
            md.append(f"| {m['model']} | {r['prompt_tokens']} | {r['dualdecoder_tokens_per_s']:.1f} | "
                      f"{r['llama_cpp_tokens_per_s']:.1f} | {r['ratio']:.2f} | {r['peak_rss_mib']:.0f} | "
                      f"{r['kv_mib']:.0f} | {r['projected_device_mib']:.0f} |")
    md.append("")
    cl.write_results("prefill-vs-llamacpp", doc, md)


if __name__ == "__main__":
    main()
