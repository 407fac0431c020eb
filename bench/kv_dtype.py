#!/usr/bin/env python3
"""f16 KV against f32 KV, side by side in one run (docs/decisions/0049-kv-storage-type.md).

For each model, in alternating rounds (f32, f16, f32, f16, ...):
  - CPU decode in full mode (dd-bench-model): tokens/s at the given contexts and batches;
  - the dual-token pipeline (dd-bench-modes, dualdecoder and sparse-cached, in-process store,
    the calibrated pcie5 link): KV bytes per decode step (urgent + prefetched), step time,
    and the largest batch the memory plan admits under one device budget.
Writes bench/results/<name>.json (every round's figures, the medians, f16/f32 ratios) and a
short <name>.md; records the command, the preset and the git sha.

Usage: python3 bench/kv_dtype.py [--rounds 3] [--quick] [--name kv-dtype]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wrap_results  # noqa: E402  (machine(), git_sha())

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("DD_BIN_DIR", os.path.join(ROOT, "build", "bin"))
MODELS = os.path.expanduser("~/.cache/dualdecoder/models")
MODEL_FILES = {"gemma": "gemma-3-270m-q4_k_m.gguf", "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}
DTYPES = ("f32", "f16")


def run_json(cmd):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        print("kv_dtype:", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd + ["--out", out], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def decode_round(model, dtype, contexts, batches, steps):
    doc = run_json([os.path.join(BIN, "dd-bench-model"), "--model", model, "--prefill", "128",
                    "--contexts", ",".join(map(str, contexts)), "--batches", ",".join(map(str, batches)),
                    "--decode_steps", str(steps), "--threads", "2", "--kv_dtype", dtype])
    return {f"{d['context']}/b{d['batch']}": d["tokens_per_s"] for d in doc["decode"]}


def modes_round(model, dtype, context, steps, device_memory):
    doc = run_json([os.path.join(BIN, "dd-bench-modes"), "--model", model, "--contexts", str(context),
                    "--batches", "1", "--steps", str(steps), "--modes", "sparse-cached,dualdecoder",
                    "--stores", "inproc", "--spec_heads", "context", "--device_memory", device_memory,
                    "--threads", "2", "--kv_dtype", dtype])
    out = {}
    for r in doc["runs"]:
        out[r["mode"]] = {"bytes_per_step": r["urgent_bytes_per_step"] + r["prefetch_bytes_per_step"],
                          "urgent_bytes_per_step": r["urgent_bytes_per_step"],
                          "step_ms_p50": r["step_ms_p50"], "tokens_per_s": r["tokens_per_s"]}
    for m in doc.get("max_batch", []):
        out.setdefault(m["mode"], {})["max_batch"] = m["max_batch"]
    return out


def ratio_stats(pairs):
    """f16/f32 per round, and their median, min and max."""
    r = [b / a for a, b in pairs if a > 0]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "per_round": r} if r else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one round, shorter runs")
    p.add_argument("--name", default="kv-dtype")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--models", default="gemma,smollm2")
    a = p.parse_args()
    rounds = 1 if a.quick else a.rounds
    steps = 8 if a.quick else 24
    plan = {  # model: (decode contexts, decode batches, dual-token context)
        "gemma": ([8000, 32000], [1, 4], 4096),
        "smollm2": ([8000], [1, 4], 4096),
    }
    results = {}
    for name in a.models.split(","):
        model = os.path.join(MODELS, MODEL_FILES[name])
        contexts, batches, dual_ctx = plan[name]
        rec = {"decode": {t: [] for t in DTYPES}, "modes": {t: [] for t in DTYPES}}
        for i in range(rounds):
            for t in DTYPES:
                print(f"kv_dtype: {name} round {i + 1}/{rounds} {t}", file=sys.stderr, flush=True)
                rec["decode"][t].append(decode_round(model, t, contexts, batches, steps))
                rec["modes"][t].append(modes_round(model, t, dual_ctx, steps, "1GiB"))
        summary = {"decode_f16_over_f32": {}, "modes": {}}
        for key in rec["decode"]["f32"][0]:
            pairs = [(rec["decode"]["f32"][i][key], rec["decode"]["f16"][i][key]) for i in range(rounds)]
            summary["decode_f16_over_f32"][key] = ratio_stats(pairs)
        for mode in rec["modes"]["f32"][0]:
            f32 = rec["modes"]["f32"][0][mode]
            f16 = rec["modes"]["f16"][0][mode]
            s = {}
            if f32.get("bytes_per_step"):
                s["bytes_per_step_f16_over_f32"] = f16["bytes_per_step"] / f32["bytes_per_step"]
            if f32.get("max_batch"):
                s["max_batch"] = {"f32": f32["max_batch"], "f16": f16["max_batch"],
                                  "f16_over_f32": f16["max_batch"] / f32["max_batch"]}
            if f32.get("step_ms_p50"):
                s["step_ms_f32_over_f16"] = ratio_stats(
                    [(rec["modes"]["f16"][i][mode]["step_ms_p50"], rec["modes"]["f32"][i][mode]["step_ms_p50"])
                     for i in range(rounds)])
            summary["modes"][mode] = s
        results[name] = {"rounds": rec, "summary": summary, "dual_token_context": dual_ctx}
    doc = {"name": a.name, "command": "python3 bench/kv_dtype.py " + " ".join(sys.argv[1:]),
           "preset": "quick" if a.quick else f"{rounds} rounds", "git_sha": wrap_results.git_sha(),
           "machine": wrap_results.machine(), "threads": 2, "device_memory": "1GiB", "results": results}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, a.name + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# {a.name}: f16 KV against f32 KV", "",
             f"`{doc['command']}` at {doc['git_sha']}, {doc['machine']['cpu']}, 2 threads, {doc['preset']} "
             "(f32 and f16 alternating).", "",
             "| model | measure | f16 / f32 (median, range over rounds) |", "|---|---|---|"]
    for name, r in results.items():
        for key, s in r["summary"]["decode_f16_over_f32"].items():
            lines.append(f"| {name} | full-mode decode tokens/s at {key} | {s['median']:.2f} "
                         f"({s['min']:.2f}–{s['max']:.2f}) |")
        for mode, s in r["summary"]["modes"].items():
            ctx = r["dual_token_context"]
            if "bytes_per_step_f16_over_f32" in s:
                lines.append(f"| {name} | {mode} KV bytes per step at {ctx} | {s['bytes_per_step_f16_over_f32']:.2f} |")
            if "step_ms_f32_over_f16" in s and s["step_ms_f32_over_f16"]:
                v = s["step_ms_f32_over_f16"]
                lines.append(f"| {name} | {mode} step speed at {ctx}, batch 1 | {v['median']:.2f} "
                             f"({v['min']:.2f}–{v['max']:.2f}) |")
            if "max_batch" in s:
                m = s["max_batch"]
                lines.append(f"| {name} | {mode} max batch in 1 GiB at {ctx} | {m['f16_over_f32']:.2f} "
                             f"({m['f32']} → {m['f16']}) |")
    with open(os.path.join(a.out_dir, a.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
