"""Side-by-side CPU comparison with llama.cpp on the same GGUF file, in one run.

Needs the optional `llama-cpp-python` package (it compiles llama.cpp, ~15 min on 2 cores;
not installed by scripts/install-deps):  python3 -m pip install llama-cpp-python
Then:  python3 bench/compare_llamacpp.py [--model PATH] [--threads 2]

Measures, for both engines alternately: prefill tokens/s at 1K and 8K prompt tokens and decode
tokens/s at batch 1 at those contexts (the llama.cpp Python API decodes one sequence), on the
same natural-text prompt. Writes bench/results/model-cpu-vs-llamacpp.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "eval"))
import haystack  # noqa: E402
import models  # noqa: E402
import wrap_results  # noqa: E402


def llamacpp_run(model, lengths, steps, threads):
    from llama_cpp import Llama
    text = Path(haystack.license_path("GPL-3")).read_text()
    out = {"prefill": [], "decode": []}
    for n in lengths:
        llm = Llama(model_path=model, n_ctx=n + steps + 8, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False)
        toks = llm.tokenize(text.encode(), add_bos=True)
        while len(toks) < n:
            toks += toks[1:]
        toks = toks[:n]
        t0 = time.perf_counter()
        llm.eval(toks)
        t1 = time.perf_counter()
        out["prefill"].append({"prompt_tokens": n, "tokens_per_s": n / (t1 - t0)})
        nxt = toks[-1]
        llm.eval([nxt])  # warm-up step
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([nxt])
        t1 = time.perf_counter()
        out["decode"].append({"context": n, "batch": 1, "tokens_per_s": steps / (t1 - t0)})
        del llm
    return out


def ours_run(model, lengths, steps, threads):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        lens = ",".join(str(n) for n in lengths)
        subprocess.run([str(REPO / "build" / "bin" / "dd-bench-model"), "--model", model, "--prefill", lens,
                        "--contexts", lens, "--batches", "1", "--decode_steps", str(steps),
                        "--threads", str(threads), "--out", f.name], check=True)
        return json.load(open(f.name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model file or short name gemma|smollm2 (default $DD_MODEL, else gemma)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lengths", default="1024,8192")
    a = ap.parse_args()
    a.model = str(models.model_path(a.model))
    lengths = [int(x) for x in a.lengths.split(",")]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("compare_llamacpp: llama-cpp-python is not installed (python3 -m pip install llama-cpp-python)")
    runs = []
    for rnd in range(2):  # alternate the engines to spread machine noise over both
        runs.append({"round": rnd, "dualdecoder": ours_run(a.model, lengths, a.steps, a.threads),
                     "llama_cpp": llamacpp_run(a.model, lengths, a.steps, a.threads)})
    rows = []
    for kind, key in (("prefill", "prompt_tokens"), ("decode", "context")):
        for n in lengths:
            ours = max(r2["tokens_per_s"] for r in runs for r2 in r["dualdecoder"][kind]
                       if r2[key] == n and r2.get("batch", 1) == 1)
            theirs = max(r2["tokens_per_s"] for r in runs for r2 in r["llama_cpp"][kind] if r2[key] == n)
            rows.append({"what": kind, "tokens": n, "dualdecoder_tokens_per_s": ours,
                         "llama_cpp_tokens_per_s": theirs, "ratio": ours / theirs})
    doc = {"benchmark": "model-cpu-vs-llamacpp", "git_sha": wrap_results.git_sha(),
           "machine": wrap_results.machine(), "threads": a.threads,
           "llama_cpp_python": __import__("llama_cpp").__version__, "model": a.model,
           "summary": rows, "runs": runs}
    out = REPO / "bench" / "results" / "model-cpu-vs-llamacpp.json"
    out.write_text(json.dumps(doc, indent=2))
    md = ["# DualDecoder vs llama.cpp, CPU, same GGUF, one run (best of 2 alternating rounds)", "",
          f"{doc['machine']['cpu']}, {a.threads} threads, llama-cpp-python {doc['llama_cpp_python']}, "
          f"git {doc['git_sha'][:12]}", "",
          "| | tokens | DualDecoder tok/s | llama.cpp tok/s | ratio |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['what']} | {r['tokens']} | {r['dualdecoder_tokens_per_s']:.1f} | "
                  f"{r['llama_cpp_tokens_per_s']:.1f} | {r['ratio']:.2f} |")
    md.append("")
    (REPO / "bench" / "results" / "model-cpu-vs-llamacpp.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
