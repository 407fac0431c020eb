"""CPU decode against llama.cpp on the same GGUF files, side by side in one run.

llama.cpp's own batched benchmark (llama-batched-bench) is built from the llama.cpp tree pinned
by bench/build-llamacpp (outside the repository, ~15 min on 2 cores once). For each model it is
run in two configurations:
  like-for-like     flash attention on, sliding-window layers keep only their window (what
                    DualDecoder's full mode does), the same thread count;
  library defaults  what llama.cpp's library API does when left alone (llama-cpp-python's
                    `Llama()`): full-size KV on sliding-window layers (--swa-full), flash
                    attention auto.
Beside them, dd-bench-model (DualDecoder's full mode, int8 matmuls). Both engines prefill one
prompt of C tokens and continue it as B sequences (llama.cpp copies the prompt's KV, -pps;
dd-bench-model forks it), then time the decode steps: the figure is decode at context C and
batch B, not B prefills. Rounds alternate the engines; each figure is the best of the rounds.

  bench/compare_llamacpp.py [--models gemma,smollm2] [--contexts 1024,8000] [--batches 1,8]
                            [--threads 2] [--steps 32] [--rounds 2] [--isa native|avx2]
Writes bench/results/model-cpu-vs-llamacpp.{json,md}. --isa avx2 compares the AVX2 paths on an
AVX-512 machine: DualDecoder built with -mno-avx512f (build-avx2/, docs/development.md) against
llama.cpp built without AVX-512 (DD_LLAMACPP_ISA=avx2 bench/build-llamacpp), written to
model-cpu-vs-llamacpp-avx2.{json,md}.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "eval"))
import models  # noqa: E402
import wrap_results  # noqa: E402

CONFIGS = {
    "like-for-like": ["-fa", "on"],
    "library-defaults": ["-fa", "auto", "--swa-full"],
}


def llamacpp_bin(isa):
    out = subprocess.run([str(REPO / "bench" / "build-llamacpp")], check=True, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, DD_LLAMACPP_ISA=isa))
    return Path(out.stdout.strip().splitlines()[-1])


def llamacpp_run(binary, model, contexts, batches, steps, threads, flags):
    # Non-unified KV: every sequence has its own cells (pl * (pp + tg) of them).
    n_ctx = max(batches) * (max(contexts) + steps)
    n_ctx = int(math.ceil(n_ctx / 256) * 256)
    cmd = [str(binary / "llama-batched-bench"), "-m", model, "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-t", str(threads), "-tb", str(threads), "-npp", ",".join(map(str, contexts)), "-ntg", str(steps),
           "-npl", ",".join(map(str, batches)), "-pps", "--output-format", "jsonl", *flags]
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"compare_llamacpp: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("{")]
    if len(rows) != len(contexts) * len(batches):
        sys.exit(f"compare_llamacpp: expected {len(contexts) * len(batches)} results from llama-batched-bench, "
                 f"got {len(rows)}:\n{proc.stderr[-2000:]}")
    print(f"compare_llamacpp: llama.cpp {' '.join(flags)} {Path(model).name}: {time.time() - t0:.0f} s",
          file=sys.stderr)
    return {"command": cmd, "decode": [{"context": r["pp"], "batch": r["pl"], "tokens_per_s": r["speed_tg"]}
                                       for r in rows],
            "prefill": [{"prompt_tokens": r["pp"], "tokens_per_s": r["speed_pp"]} for r in rows]}


def ours_build(isa):
    return REPO / ("build-avx2" if isa == "avx2" else "build") / "bin" / "dd-bench-model"


def ours_run(model, contexts, batches, steps, threads, isa):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [str(ours_build(isa)), "--model", model, "--device", "cpu",
               "--prefill", ",".join(map(str, contexts)), "--contexts", ",".join(map(str, contexts)),
               "--batches", ",".join(map(str, batches)), "--decode_steps", str(steps),
               "--threads", str(threads), "--out", f.name]
        t0 = time.time()
        subprocess.run(cmd, check=True)
        print(f"compare_llamacpp: dualdecoder {Path(model).name}: {time.time() - t0:.0f} s", file=sys.stderr)
        out = json.load(open(f.name))
        out["command"] = cmd
        return out


def add_record_args(ap):
    """--preset / --command: what bench/run ran, written into the results as given."""
    ap.add_argument("--preset", default="", help="recorded in the results (bench/run passes it)")
    ap.add_argument("--command", default="", help="recorded in the results (bench/run passes it)")


def record(a, script):
    """The results' command/preset fields (the script's own argv when not run by bench/run)."""
    return {"command": a.command or " ".join([script, *sys.argv[1:]]), "preset": a.preset,
            "script_args": sys.argv[1:]}


def write_results(name, doc, md):
    """bench/results/<name>.json and .md; the summary is printed too."""
    (REPO / "bench" / "results" / f"{name}.json").write_text(json.dumps(doc, indent=2))
    (REPO / "bench" / "results" / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


def best(runs, engine, kind, key, n, batch):
    vals = [r2["tokens_per_s"] for r in runs for r2 in r[engine][kind]
            if r2[key] == n and r2.get("batch", 1) == batch]
    return max(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma,smollm2", help="short names or paths, comma-separated")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--contexts", default="1024,8000",
                    help="8000, not 8192: SmolLM2's context is 8192 tokens and the decode steps need room")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: both engines built for an AVX2 CPU without AVX-512")
    add_record_args(ap)
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    if min(contexts) < 16 or min(batches) < 1 or a.steps < 1 or a.rounds < 1 or a.threads < 1:
        sys.exit("compare_llamacpp: contexts >= 16, batches, steps, rounds and threads >= 1")
    if not ours_build(a.isa).exists():
        sys.exit(f"compare_llamacpp: {ours_build(a.isa)} is missing (run scripts/build"
                 + (', with CXXFLAGS="-mno-avx512f" DD_BUILD_DIR=build-avx2' if a.isa == "avx2" else "") + ")")
    binary = llamacpp_bin(a.isa)
    per_model = []
    for name in a.models.split(","):
        path = str(models.model_path(name))
        runs = []
        for rnd in range(a.rounds):
            run = {"round": rnd, "dualdecoder": ours_run(path, contexts, batches, a.steps, a.threads, a.isa)}
            for cfg, flags in CONFIGS.items():
                run[cfg] = llamacpp_run(binary, path, contexts, batches, a.steps, a.threads, flags)
            runs.append(run)
        rows = []
        for c in contexts:
            for b in batches:
                ours = best(runs, "dualdecoder", "decode", "context", c, b)
                row = {"context": c, "batch": b, "dualdecoder_tokens_per_s": ours}
                for cfg in CONFIGS:
                    theirs = best(runs, cfg, "decode", "context", c, b)
                    row[f"{cfg}_tokens_per_s"] = theirs
                    row[f"ratio_vs_{cfg}"] = ours / theirs if ours and theirs else None
                rows.append(row)
        prefill = []
        for c in contexts:
            ours = best(runs, "dualdecoder", "prefill", "prompt_tokens", c, 1)
            theirs = best(runs, "like-for-like", "prefill", "prompt_tokens", c, 1)
            prefill.append({"prompt_tokens": c, "dualdecoder_tokens_per_s": ours, "llama_cpp_tokens_per_s": theirs,
                            "ratio": ours / theirs if ours and theirs else None})
        per_model.append({"model": name, "path": path, "decode": rows, "prefill": prefill, "runs": runs})
    name = "model-cpu-vs-llamacpp" + ("-avx2" if a.isa == "avx2" else "")
    doc = {"benchmark": name, "isa": a.isa, "git_sha": wrap_results.git_sha(), "machine": wrap_results.machine(),
           **record(a, "bench/compare_llamacpp.py"), "threads": a.threads, "steps": a.steps,
           "llamacpp_source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp (bench/build-llamacpp)",
           "llamacpp_configs": CONFIGS, "models": per_model}
    md = ["# CPU decode: DualDecoder (full mode) vs llama.cpp, same GGUF, one run"
          + (" (AVX2 builds of both, no AVX-512)" if a.isa == "avx2" else ""), "",
          f"{doc['machine']['cpu']}, {a.threads} threads, git {doc['git_sha'][:12]}, "
          f"best of {a.rounds} alternating rounds, {a.steps} decode steps; `{doc['command']}`", "",
          "like-for-like: llama.cpp `-fa on`, windowed sliding-window cache; library defaults: "
          "`-fa auto --swa-full` (what `Llama()` does). Both engines prefill once and continue B copies.", "",
          "| model | context | batch | DualDecoder tok/s | llama.cpp like-for-like | ratio | "
          "llama.cpp defaults | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in per_model:
        for r in m["decode"]:
            md.append(f"| {m['model']} | {r['context']} | {r['batch']} | {r['dualdecoder_tokens_per_s']:.1f} | "
                      f"{r['like-for-like_tokens_per_s']:.1f} | {r['ratio_vs_like-for-like']:.2f} | "
                      f"{r['library-defaults_tokens_per_s']:.1f} | {r['ratio_vs_library-defaults']:.2f} |")
    md += ["", "Prefill of the same runs (one prompt; bench/compare_prefill.py compares prefill):", "",
           "| model | prompt tokens | DualDecoder tok/s | llama.cpp like-for-like tok/s | ratio |",
           "|---|---:|---:|---:|---:|"]
    for m in per_model:
        for r in m["prefill"]:
            md.append(f"| {m['model']} | {r['prompt_tokens']} | {r['dualdecoder_tokens_per_s']:.1f} | "
                      f"{r['llama_cpp_tokens_per_s']:.1f} | {r['ratio']:.2f} |")
    md.append("")
    write_results(name, doc, md)


if __name__ == "__main__":
    main()
