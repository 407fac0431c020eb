#!/usr/bin/env python3
"""The engine's decode benchmark on a device: every mode side by side per model shape.

    python3 bench/gpu_engine.py --bin DIR --out-dir DIR [--device cuda] [--git-sha SHA]

Runs on a bare GPU machine (scripts/gpu-check): it needs only DIR/ddctl and DIR/dd-bench-modes,
python3's standard library and the GPL-3 text (--text-file). The real models cannot reach such a
machine, so the models are synthetic ones of the real models' shapes, written here by
`ddctl synth-model` (decode-worker/model/synthetic_model.h): a step costs what the real model's
costs, but random weights do not attend like trained ones, so hit rates and transfer figures
say nothing about the real models (their own are measured on the CPU).

Per shape (gemma3-270m, smollm2-135m): full, sparse, sparse-cached and dualdecoder at batch 1,
8 and each mode's largest under --device-memory (capped at 64), 4096-token contexts, the
in-process store on an infinite link and on the pcie5 link calibrated in the run. Then full at
batch 1 on the Llama-3.1-8B shape (Q4_K), whose weight bytes per second are compared with the
GPU's HBM bandwidth (the 60% target of docs/decisions/0034-gpu-kernels-groundwork.md). On cuda, the
small shape's full and dualdecoder at batch 1 and 8 and the 8B shape's full step again with
--cuda_graphs, beside the runs without.
Writes gpu-engine.json and gpu-engine.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import wrap_results  # bench/wrap_results.py (standard library at import): machine()

# Nominal HBM bandwidth by GPU name (NVIDIA's data sheets), for the roofline fraction.
HBM_GBPS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H100": 3350.0}

SHAPES = ("gemma3-270m", "smollm2-135m")
# Each model's default speculative head (--spec_heads auto): Gemma's context head runs as
# `dualdecoder`, SmolLM2's full head as `dualdecoder-fullhead`.
MODES = {"gemma3-270m": "full,sparse,sparse-cached,dualdecoder",
         "smollm2-135m": "full,sparse,sparse-cached,dualdecoder-fullhead"}


# The same runs again with static segments as CUDA graphs (--cuda_graphs), where launches
# weigh most: the small shape at batch 1 and 8, the 8B shape's full step.
GRAPHS = "+graphs"
GRAPH_RUNS = {"gemma3-270m": ["--batches", "1,8", "--modes", "full,dualdecoder"], "llama-3.1-8b": []}


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def hbm_gbps(name: str) -> float | None:
    for key in sorted(HBM_GBPS, key=len, reverse=True):  # the most specific name first
        if key in name:
            return HBM_GBPS[key]
    return None


def check_inputs(who: str, a) -> None:
    """Exits naming what is missing: a.bin's ddctl and dd-bench-modes, a.text_file; makes a.out_dir."""
    for b in ("ddctl", "dd-bench-modes"):
        if not os.access(os.path.join(a.bin, b), os.X_OK):
            sys.exit(f"{who}: {b} not found in {a.bin}")
    if not os.path.exists(a.text_file):
        sys.exit(f"{who}: --text-file {a.text_file} not found (the prompts' text)")
    os.makedirs(a.out_dir, exist_ok=True)


def write_outputs(out_dir: str, name: str, doc: dict, md: str) -> None:
    """NAME.json and NAME.md in out_dir."""
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(doc, f, indent=2)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(md)
    print(f"{name}: wrote {out_dir}/{name}.json and .md", file=sys.stderr)


def run(cmd: list[str], timeout: float, log, who: str = "gpu_engine") -> subprocess.CompletedProcess:
    """Runs cmd, its stderr into log; progress lines on stderr, prefixed with who."""
    print(f"{who}: " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log.write(f"$ {' '.join(cmd)}\n{r.stderr}\n")
    log.flush()
    print(f"{who}: rc {r.returncode} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return r


def synth_model(a, shape: str, path: str, log, who: str = "gpu_engine") -> str | None:
    """Writes the shape's synthetic model to path with a.bin's ddctl; None, or what went wrong."""
    try:
        r = run([os.path.join(a.bin, "ddctl"), "synth-model", "--shape", shape, "--out", path], 300, log, who)
    except subprocess.TimeoutExpired:
        return "synth-model ran past 300 s"
    return None if r.returncode == 0 else f"synth-model failed: {r.stderr.strip()[-500:]}"


def bench_shape(a, tmp: str, shape: str, variants: dict[str, list[str]], log) -> dict[str, dict]:
    """Writes the shape's model, runs dd-bench-modes on it once per variant (label: its flags);
    each variant's raw results, or the error."""
    model = os.path.join(tmp, shape + ".gguf")
    err = synth_model(a, shape, model, log)
    if err:
        return {label: {"error": err} for label in variants}
    out = {}
    try:
        for label, extra in variants.items():
            raw = os.path.join(tmp, shape + label + ".json")
            cmd = [os.path.join(a.bin, "dd-bench-modes"), "--model", model, "--device", a.device, "--device_memory",
                   a.device_memory, "--text_file", a.text_file, "--stores", "inproc", "--spec_heads", "auto",
                   "--decode_threads", "0", "--out", raw] + extra
            try:
                r = run(cmd, a.timeout, log)
            except subprocess.TimeoutExpired:
                out[label] = {"error": f"dd-bench-modes ran past {a.timeout} s"}
                continue
            if r.returncode != 0:
                out[label] = {"error": f"dd-bench-modes rc {r.returncode}: {r.stderr.strip()[-800:]}"}
                continue
            with open(raw) as f:
                out[label] = json.load(f)
    finally:
        os.remove(model)
    return out


def step_ms(runs: list[dict], mode: str, batch: int, link: str) -> float | None:
    for x in runs:
        if x["mode"] == mode and x["batch"] == batch and x["link"] == link:
            return x["step_ms_p50"]
    return None


def summary(doc: dict) -> str:
    r = doc["results"]
    lines = [f"# The engine on {doc['device']} ({doc['gpu']})", "",
             f"git {doc['git_sha'][:12]}, {doc['date']}, `{doc['command']}`. Models: synthetic, random weights "
             "in the real models' shapes and block types (`ddctl synth-model`), so a step costs what the real "
             "model's does, while hit rates and bytes moved say nothing about the real models. Every engine runs "
             f"under a device-memory budget of {doc['device_memory']}; {doc['context']}-token contexts, a sparse budget "
             f"of {doc['budget']} tokens; `inmem` is an "
             "infinitely fast link, `pcie5` the link calibrated in the run.", ""]
    for shape in SHAPES:
        res = r.get(shape, {"error": "not run"})
        lines += [f"## {shape}", ""]
        if "error" in res:
            lines += [f"Not measured: {res['error']}", ""]
            continue
        lines += ["| mode | batch | link | tok/s | step ms (p50) | step / sparse's | step / sparse-cached's | "
                  "max batch |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        runs = res["runs"]

        def over(x, base_mode):
            base = step_ms(runs, base_mode, x["batch"], x["link"])
            return x["step_ms_p50"] / base if base else None

        for x in runs:
            cells = [f"{v:.2f}×" if v else "–" for v in (over(x, "sparse"), over(x, "sparse-cached"))]
            lines.append(f"| {x['mode']} | {x['batch']} | {x['link']} | {x['tokens_per_s']:.1f} | "
                         f"{x['step_ms_p50']:.2f} | {cells[0]} | {cells[1]} | {x['max_batch_in_budget']} |")
        # The speculative row's cost: dualdecoder against sparse-cached, which differs from it only
        # by that row and its prefetches (same resident set), on the infinite link.
        duals = [(x["batch"], over(x, "sparse-cached")) for x in runs
                 if x["mode"].startswith("dualdecoder") and x["link"] == "inmem" and over(x, "sparse-cached")]
        if duals:
            worst = max(d for _, d in duals)
            lines += ["", "The dual-token step over a sparse-cached step (inmem; the same resident set, plus the "
                      "speculative row): " + ", ".join(f"batch {b} {d:.2f}×" for b, d in duals)
                      + f"; target ≤ 1.1×: {'met' if worst <= 1.1 else f'missed (worst {worst:.2f}×)'}."]
        lines.append("")
    lines += ["## Llama-3.1-8B shape, full mode, batch 1", ""]
    big = r.get("llama-3.1-8b", {"error": "not run"})
    if "error" in big:
        lines.append(f"Not measured: {big['error']}")
    else:
        x = next((x for x in big["runs"] if x["mode"] == "full" and x["link"] == "inmem"), None)
        if x is None:
            lines.append("Not measured: no full-mode run in the results.")
        else:
            gbps = big["step_weight_bytes"] / (x["step_ms_p50"] / 1e3) / 1e9
            peak = doc.get("hbm_gbps")
            frac = f"{gbps / peak:.0%} of the nominal {peak:.0f} GB/s" if peak else "nominal HBM bandwidth unknown"
            lines.append(f"{x['tokens_per_s']:.1f} tok/s, step {x['step_ms_p50']:.2f} ms: the weights "
                         f"({big['step_weight_bytes'] / 1e9:.2f} GB per step) at {gbps:.0f} GB/s, {frac} "
                         "(target ≥ 60%).")
    lines += graph_lines(r)
    return "\n".join(lines) + "\n"


def graph_lines(r: dict) -> list[str]:
    """The runs with CUDA graphs beside the same runs without."""
    lines = ["", "## Static segments as CUDA graphs (`--cuda_graphs`)", ""]
    rows = []
    for shape in GRAPH_RUNS:
        with_graphs, without = r.get(shape + GRAPHS), r.get(shape)
        if with_graphs is None:
            continue
        err = with_graphs.get("error") or (without or {"error": "no run without graphs"}).get("error")
        if err:
            rows.append(f"| {shape} | – | – | – | – | not measured: {err} |")
            continue
        for x in with_graphs["runs"]:
            base = step_ms(without["runs"], x["mode"], x["batch"], x["link"])
            if base is None or x["link"] != "inmem":
                continue
            rows.append(f"| {shape} | {x['mode']} | {x['batch']} | {base:.2f} | {x['step_ms_p50']:.2f} | "
                        f"{base / x['step_ms_p50']:.2f}× |")
    if not rows:
        return []
    return lines + ["| shape | mode | batch | step ms without | with graphs | speed-up |", "|---|---|---:|---:|---:|---:|"] + rows

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory holding ddctl and dd-bench-modes")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--device-memory", default="32GiB")
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--text-file", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,8,max")
    ap.add_argument("--budget", type=int, default=1024, help="sparse budget in tokens")
    ap.add_argument("--big-context", type=int, default=512, help="the 8B shape's context")
    ap.add_argument("--shapes", default=",".join(SHAPES) + ",llama-3.1-8b",
                    help="which of gemma3-270m, smollm2-135m, llama-3.1-8b to run")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per dd-bench-modes run")
    ap.add_argument("--tmp", default=None, help="where the synthetic models are written (default: a temporary "
                                                "directory; the 8B shape needs 4.7 GB)")
    a = ap.parse_args()
    check_inputs("gpu_engine", a)
    wanted = [s for s in a.shapes.split(",") if s]
    gpu = gpu_name()
    doc = {"benchmark": "gpu-engine", "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "git_sha": a.git_sha,
           "device": a.device, "gpu": gpu, "hbm_gbps": hbm_gbps(gpu), "device_memory": a.device_memory, "context": a.context, "budget": a.budget,
           "machine": wrap_results.machine(), "results": {}}
    tmp = tempfile.mkdtemp(prefix="dd-gpu-engine-", dir=a.tmp)
    failed = False
    try:
        with open(os.path.join(a.out_dir, "gpu-engine.log"), "w") as log:
            for shape in wanted:
                if shape == "llama-3.1-8b":
                    extra = ["--contexts", str(a.big_context), "--batches", "1", "--steps", str(a.steps), "--modes", "full",
                             "--budget", "16"]  # full only: the budget is unused
                else:
                    extra = ["--contexts", str(a.context), "--batches", a.batches, "--steps", str(a.steps),
                             "--modes", MODES[shape], "--budget", str(a.budget)]
                variants = {"": extra}
                if a.device == "cuda" and shape in GRAPH_RUNS:
                    variants[GRAPHS] = extra + GRAPH_RUNS[shape] + ["--cuda_graphs"]
                for label, res in bench_shape(a, tmp, shape, variants, log).items():
                    doc["results"][shape + label] = res
                    failed |= "error" in res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_outputs(a.out_dir, "gpu-engine", doc, summary(doc))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
