#!/usr/bin/env python3
"""The paper's headline on the paper's shape: every decode mode on a Llama-3.1-8B-shaped model.

    python3 bench/gpu_decode_modes.py --bin DIR --out-dir DIR [--preset gpu-check|full|cpu-smoke]

Runs on a bare GPU machine (scripts/gpu-check, `bench/run gpu-decode-modes`). It needs only
DIR/ddctl, DIR/dd-bench-modes, DIR/dd-kv-pool (for the pool stores), python3's standard library
and a text file for the prompts.

- **Model.** `ddctl synth-model --shape llama-3.1-8b` writes a Q4_K model of the shape here:
  random weights, never downloaded.
- **Context.** Each context is random KV (`--synthetic_kv`, Engine::PrefillSynthetic), not a
  computed prefill.
- **Selection.** Random weights do not attend like a trained model, so the chunks follow the
  stated selection model (decode-worker/engine/selection_model.h, decision 0040). It runs at
  the overlap and resident waste measured on the real models, and sweeps the speculative hit
  rate.
- **Runs.** `full`, `sparse`, `sparse-cached` and `dualdecoder` side by side under one
  device-memory budget, per context, store and batch. The stores are the in-process store (host
  memory: on a GPU its transfers are real PCIe copies), a `shm://` pool and `ucx://` pools.
  On cuda, a variant at 32K runs the prefetches on the copy engines
  (`--cuda_copy_engine_prefetch`) instead of the gather kernel, beside the default's rows: the
  measure of which to make the default. Variants decide no target.
- **Per run.** Tokens/s, transfer wait and bytes per step, the measured hit rate, and the
  infinite-link figure: the same steps without their transfer wait.
- **Beside them.** The PCIe ceiling and the urgent-gather rate while compute runs, from
  gpu-gather.json when the same gpu-check wrote one.
- **Output.** gpu-decode-modes.json, .md and .log.

Host memory bounds the batches run: the KV is float32, 34 GB per 128K-token request of this
shape. A batch that does not fit is reported, not run. Each mode's largest batch under the
budget (MemoryPlan) is reported whether run or not.
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

import wrap_results  # bench/wrap_results.py (standard library at import): machine(), git_sha()
from gpu_engine import check_inputs, gpu_name, run, synth_model, write_outputs  # bench/gpu_engine.py

WHO = "gpu_decode_modes"

# (layers, KV heads, head dim): the host KV a request holds (float32 K and V per position).
SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (30, 3, 64), "gemma3-270m": (18, 1, 256)}
MODES = "full,sparse,sparse-cached,dualdecoder"
SPARSE_MODES = "sparse,sparse-cached,dualdecoder"
# Each run: one dd-bench-modes invocation (one context; its stores and batches).
PRESETS = {
    # Inside scripts/gpu-check (minutes): 32K on PCIe and a shm:// pool, 128K on PCIe. 72 GiB:
    # full mode's two 128K requests (slot 0 and one fork, 34 GB of KV each) beside the weights.
    "gpu-check": {"shape": "llama-3.1-8b", "hits": [0.99, 0.95, 0.85, 0.7], "steps": 12, "budget": 2048,
                  "device_memory": "72GiB", "timeout": 300,
                  "runs": [{"context": 32768, "batches": "1,8,max", "stores": "inproc"},
                           # A pool's region is pinned whole by the device: smaller batches.
                           {"context": 32768, "batches": "1,4", "stores": "shm", "modes": SPARSE_MODES},
                           # ucx:// pools (shared memory and tcp loopback): staged landings.
                           {"context": 32768, "batches": "1", "stores": "ucx-sm,ucx-tcp", "modes": SPARSE_MODES},
                           {"context": 130000, "batches": "1,max", "stores": "inproc",
                            "modes": "full,sparse-cached,dualdecoder"},
                           # Prefetches by the copy engines instead of the gather kernel (a
                           # variant: it decides no target; beside the first run's rows).
                           {"context": 32768, "batches": "1,8", "stores": "inproc", "modes": "sparse-cached,dualdecoder",
                            "extra": ["--cuda_copy_engine_prefetch"], "label": "copy-engine prefetches",
                            "cuda_only": True}]},
    # A session of its own: every store, 32K to 128K, a finer sweep.
    "full": {"shape": "llama-3.1-8b", "hits": [0.99, 0.95, 0.9, 0.85, 0.8, 0.7], "steps": 24, "budget": 2048,
             "device_memory": "72GiB", "timeout": 600,
             "runs": [{"context": 32768, "batches": "1,8,max", "stores": "inproc"},
                      {"context": 32768, "batches": "1,4", "stores": "shm,ucx-sm,ucx-tcp", "modes": SPARSE_MODES},
                      {"context": 65536, "batches": "1,8", "stores": "inproc"},
                      {"context": 65536, "batches": "1", "stores": "shm", "modes": SPARSE_MODES},
                      {"context": 130000, "batches": "1,max", "stores": "inproc"},
                      {"context": 130000, "batches": "1", "stores": "shm,ucx-sm", "modes": SPARSE_MODES}]},
    # The flow on a CPU (tests/cli): a small shape, a short context.
    "cpu-smoke": {"shape": "smollm2-135m", "hits": [0.95, 0.7], "steps": 3, "budget": 512, "device_memory": "2GiB",
                  "timeout": 300, "runs": [{"context": 3000, "batches": "1,2", "stores": "inproc,shm"}]},
}
# Max batch, dualdecoder over full. "128K" is 130000 tokens: the model's context is 131072, and
# the decode steps need room after the prompt.
TARGET_CONTEXTS = {32768: 4.0, 130000: 8.0}


def host_kv_bytes(shape: str, context: int) -> int:
    layers, kv_heads, head_dim = SHAPES[shape]
    return layers * kv_heads * head_dim * 2 * 4 * context


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fitting_batches(batches: str, cap: int) -> tuple[list[str], list[int]]:
    """The batches host memory can hold (`max` stays: dd-bench-modes caps it); those it cannot."""
    keep, dropped = [], []
    for b in batches.split(","):
        if b == "max" or int(b) <= cap:
            keep.append(b)
        else:
            dropped.append(int(b))
    return keep, dropped


# The infinite-link reference: overlap and hit rate 1 move nothing after the first step, with
# the same chunks attended and scored per step. Where the device gathers blocks itself (the
# in-process store, shm://) no host thread waits for a transfer, so a run's stalls are in its
# step time, not in its host wait: this run is the figure without them.
REFERENCE = "1:1:0"


def selection_specs(a) -> list[str]:
    return [f"{a.overlap}:{h}:{a.resident_waste}" for h in a.hits] + [REFERENCE]


def is_reference(selection: str) -> bool:
    parts = selection.split(":")
    return len(parts) >= 2 and float(parts[0]) == 1 and float(parts[1]) == 1


def bench_context(a, p: dict, spec: dict, model: str, tmp: str, log) -> dict:
    ctx = spec["context"]
    kv = host_kv_bytes(p["shape"], ctx)
    avail = mem_available()
    # Slot 0 plus the forks, each with its own KV on the host (the in-process store or the
    # pool), beside 16 GiB for the model file, the processes and the page cache.
    cap = max(0, int((avail - 16 * 2**30) / kv) - 1) if avail else 8
    batches, dropped = fitting_batches(spec["batches"], cap)
    out = {"context": ctx, "stores": spec["stores"], "host_kv_bytes_per_request": kv, "host_batch_cap": cap,
           "not_run_batches": dropped, "label": spec.get("label", "")}
    if cap < 1 or not batches:
        out["error"] = (f"host memory ({avail / 2**30:.0f} GiB available) holds no batch of {ctx}-token requests "
                        f"({kv / 2**30:.1f} GiB of KV each)")
        return out
    raw = os.path.join(tmp, f"modes-{ctx}-{spec['stores']}-{len(spec.get('extra', []))}.json")
    # A pool holds slot 0 and the largest batch's forks ('max' is capped at the host's bound).
    largest = max(cap if b == "max" else int(b) for b in batches)
    pool_gib = max(4, int((largest + 2) * kv * 1.1 / 2**30) + 1)
    cmd = [os.path.join(a.bin, "dd-bench-modes"), "--model", model, "--device", a.device,
           "--device_memory", p["device_memory"], "--text_file", a.text_file, "--contexts", str(ctx),
           "--batches", ",".join(batches), "--stores", spec["stores"], "--modes", spec.get("modes", MODES),
           "--spec_heads", "context", "--synthetic_kv", "--selection_models", ",".join(selection_specs(a)),
           "--pcie5_link=false", "--decode_threads", "0", "--steps", str(p["steps"]), "--budget", str(p["budget"]),
           "--max_batch_cap", str(cap), "--pool_memory", f"{pool_gib}GiB", "--out", raw] + spec.get("extra", [])
    try:
        r = run(cmd, p["timeout"], log, WHO)
    except subprocess.TimeoutExpired:
        out["error"] = f"dd-bench-modes ran past {p['timeout']} s"
        return out
    if r.returncode != 0:
        out["error"] = f"dd-bench-modes rc {r.returncode}: {r.stderr.strip()[-800:]}"
        return out
    with open(raw) as f:
        out["raw"] = json.load(f)
    return out


def find(runs: list[dict], mode: str, link: str, batch: int, selection: str | None) -> dict | None:
    for x in runs:
        if x["mode"] == mode and x["link"] == link and x["batch"] == batch and (
                selection is None or x.get("selection_model") == selection):
            return x
    return None


def infinite_link(runs: list[dict], x: dict) -> dict | None:
    """The same mode, link and batch under the reference model (nothing to move)."""
    for y in runs:
        if (y["mode"], y["link"], y["batch"]) == (x["mode"], x["link"], x["batch"]) and \
                is_reference(y.get("selection_model", "off")):
            return y
    return None


def hit_of(selection: str) -> float:
    return float(selection.split(":")[1])


def gather_figures(out_dir: str) -> dict | None:
    """PCIe's ceiling and the urgent gathers' rate beside compute, from this gpu-check's gpu-gather.json."""
    path = os.path.join(out_dir, "gpu-gather.json")
    try:
        with open(path) as f:
            g = json.load(f)
    except (OSError, ValueError):
        return None
    four_k = [r for r in g.get("gathers", []) if r.get("chunk_bytes") == 4096]
    return {"h2d_contiguous_gbps": g.get("contiguous", {}).get("h2d_gbps"),
            "gather_4k_best_gbps": max((r["gbps"] for r in four_k), default=None),
            "overlap": g.get("overlap", [])}


def analyse(doc: dict) -> dict:
    """The targets, each with the figure that decides it."""
    t = {"dual_over_cached": [], "dual_of_infinite": [], "max_batch": []}
    for res in doc["results"]:
        if "raw" not in res or res.get("label"):  # variants decide no target
            continue
        runs, ctx = res["raw"]["runs"], res["context"]
        for x in runs:
            if x["mode"] != "dualdecoder" or x["link"] != "inmem":  # KV over PCIe: the in-process store
                continue
            sel = x.get("selection_model", "off")
            if sel == "off" or is_reference(sel) or hit_of(sel) < 0.85:
                continue
            c = find(runs, "sparse-cached", x["link"], x["batch"], sel)
            if c and c["tokens_per_s"]:
                t["dual_over_cached"].append({"context": ctx, "batch": x["batch"], "hit": hit_of(sel),
                                              "ratio": x["tokens_per_s"] / c["tokens_per_s"]})
            inf = infinite_link(runs, x)
            if inf and inf["tokens_per_s"]:
                t["dual_of_infinite"].append({"context": ctx, "batch": x["batch"], "hit": hit_of(sel),
                                              "fraction": x["tokens_per_s"] / inf["tokens_per_s"]})
        plan = {m["mode"]: m["max_batch"] for m in res["raw"].get("max_batch", [])}
        if "full" in plan and "dualdecoder" in plan:
            t["max_batch"].append({"context": ctx, "full": plan["full"], "dualdecoder": plan["dualdecoder"],
                                   "ratio": plan["dualdecoder"] / max(1, plan["full"]),
                                   "target": TARGET_CONTEXTS.get(ctx)})
    return t


def summary(doc: dict) -> str:
    sel = doc["selection"]
    lines = [f"# Decode modes on the {doc['shape']} shape, {doc['device']} ({doc['gpu']})", "",
             f"git {doc['git_sha'][:12]}, {doc['date']}, preset `{doc['preset']}`, `{doc['command']}`.", "",
             f"- **Model:** synthetic, random weights of the {doc['shape']} shape written by `ddctl synth-model`.",
             "- **Context:** random KV (`--synthetic_kv`).",
             f"- **Selections:** the stated model of decision 0040, not the model's own attention: overlap "
             f"{sel['overlap']}, resident waste {sel['resident_waste']}, hit rate swept over "
             f"{', '.join(str(h) for h in sel['hits'])}.",
             f"- **Budget:** a sparse budget of {doc['budget']} tokens; every engine under a device-memory "
             f"budget of {doc['device_memory']}.",
             "- **Links:** `inmem` is the in-process store in host memory, whose transfers on a GPU are real "
             "PCIe copies. `shm`, `ucx-*` are a real `dd-kv-pool`.",
             "- **∞ link:** the same mode and batch under overlap and hit rate 1, which moves nothing after "
             "the first step and attends as many chunks (the row `∞`).",
             "- **Host wait:** the host's wait for store transfers. Where the device gathers blocks itself "
             "(in-process store, shm) it is 0, and the stalls are in the step time.", ""]
    g = doc.get("gather")
    if g:
        lines += [f"PCIe in the same gpu-check: contiguous host → device {g['h2d_contiguous_gbps']} GB/s; "
                  f"4 KiB chunk gathers up to {g['gather_4k_best_gbps']} GB/s (gpu-gather.md, with the rates "
                  "beside compute).", ""]
    for res in doc["results"]:
        ctx = res["context"]
        lines += [f"## {ctx} tokens, {res['stores']}" + (f", {res['label']}" if res.get("label") else ""), ""]
        if res.get("not_run_batches"):
            lines += [f"Not run for host memory ({res['host_kv_bytes_per_request'] / 2**30:.1f} GiB of KV per "
                      f"request, at most {res['host_batch_cap']} forks): batch "
                      f"{', '.join(map(str, res['not_run_batches']))}.", ""]
        if "raw" not in res:
            lines += [f"Not measured: {res.get('error', 'not run')}", ""]
            continue
        raw = res["raw"]
        plan = {m["mode"]: m["max_batch"] for m in raw.get("max_batch", [])}
        lines.append("Largest batch under the budget (MemoryPlan): " +
                     ", ".join(f"{m} {b}" for m, b in plan.items()) + ".")
        lines.append("")
        lines += ["| store | hit (set) | batch | full | sparse | sparse-cached | dualdecoder | dual / cached | "
                  "dual / ∞ link | hit (measured) | host wait ms/step (cached, dual) | urgent MB/step (cached, dual) | "
                  "prefetch MB/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        runs = [x for x in raw["runs"] if isinstance(x.get("tokens_per_s"), (int, float))]
        keys = []
        for x in runs:
            k = (x["link"], x.get("selection_model", "off"), x["batch"])
            if x["mode"] != "full" and k not in keys:
                keys.append(k)
        for link, s, batch in keys:
            def tps(mode, _link=link, _s=s, _b=batch):
                x = find(runs, mode, _link if mode != "full" else "inmem", _b, _s if mode != "full" else None)
                return x

            cells = []
            for m in ("full", "sparse", "sparse-cached", "dualdecoder"):
                x = tps(m)
                cells.append(f"{x['tokens_per_s']:.1f}" if x else "–")
            d, c = tps("dualdecoder"), tps("sparse-cached")
            ratio = f"{d['tokens_per_s'] / c['tokens_per_s']:.2f}×" if d and c and c["tokens_per_s"] else "–"
            ref = infinite_link(runs, d) if d else None
            inf = f"{d['tokens_per_s'] / ref['tokens_per_s']:.0%}" if ref and ref["tokens_per_s"] else "–"
            hit = f"{d['hit_rate']:.3f}" if d else "–"
            wait = f"{c['wait_ms_per_step']:.2f}, {d['wait_ms_per_step']:.2f}" if d and c else "–"
            urg = (f"{c['urgent_bytes_per_step'] / 1e6:.1f}, {d['urgent_bytes_per_step'] / 1e6:.1f}"
                   if d and c else "–")
            pre = f"{d['prefetch_bytes_per_step'] / 1e6:.1f}" if d else "–"
            label = "∞" if is_reference(s) else (hit_of(s) if s != "off" else "off")
            lines.append(f"| {link} | {label} | {batch} | " + " | ".join(cells) +
                         f" | {ratio} | {inf} | {hit} | {wait} | {urg} | {pre} |")
        lines.append("")
    t = doc["targets"]
    lines += ["## Targets", ""]
    if t["dual_over_cached"]:
        worst = min(t["dual_over_cached"], key=lambda v: v["ratio"])
        lines.append(f"- dualdecoder ≥ 1.5× sparse-cached at equal batch, hit rates ≥ 0.85, KV over PCIe: worst "
                     f"{worst['ratio']:.2f}× ({worst['context']} tokens, batch {worst['batch']}, hit {worst['hit']}): "
                     + ("met." if worst["ratio"] >= 1.5 else f"missed by {1.5 - worst['ratio']:.2f}×."))
    if t["dual_of_infinite"]:
        worst = min(t["dual_of_infinite"], key=lambda v: v["fraction"])
        lines.append(f"- dualdecoder ≥ 90% of its infinite-link throughput, hit rates ≥ 0.85: worst "
                     f"{worst['fraction']:.0%} ({worst['context']} tokens, batch {worst['batch']}, hit "
                     f"{worst['hit']}): " + ("met." if worst["fraction"] >= 0.9 else "missed."))
    for m in t["max_batch"]:
        if m["target"]:
            lines.append(f"- Largest batch at {m['context']} tokens: dualdecoder {m['dualdecoder']} vs full {m['full']}, "
                         f"{m['ratio']:.1f}× (target ≥ {m['target']:.0f}×): "
                         + ("met." if m["ratio"] >= m["target"] else "missed."))
    if not any(t.values()):
        lines.append("- Nothing measured decides a target here.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory holding ddctl, dd-bench-modes and dd-kv-pool")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--preset", default="gpu-check", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--git-sha", default=None, help="default: this checkout's (with -dirty)")
    ap.add_argument("--text-file", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--overlap", type=float, default=0.7, help="the selection model's overlap (decision 0040)")
    ap.add_argument("--resident-waste", type=float, default=0.4, help="the selection model's resident waste")
    ap.add_argument("--hits", default=None, help="hit rates to sweep (default: the preset's)")
    ap.add_argument("--tmp", default=None, help="where the synthetic model is written (the 8B shape: 4.7 GB)")
    a = ap.parse_args()
    p = PRESETS[a.preset]
    a.hits = [float(h) for h in a.hits.split(",")] if a.hits else p["hits"]
    for v in [a.overlap, a.resident_waste] + a.hits:
        if not 0 <= v <= 1:
            sys.exit(f"gpu_decode_modes: {v} is not a fraction in [0, 1]")
    check_inputs(WHO, a)
    gpu = gpu_name() if a.device == "cuda" else "none"
    doc = {"benchmark": "gpu-decode-modes", "preset": a.preset,
           "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": a.git_sha or wrap_results.git_sha(), "device": a.device, "gpu": gpu, "shape": p["shape"],
           "budget": p["budget"], "device_memory": p["device_memory"], "steps": p["steps"],
           "selection": {"overlap": a.overlap, "resident_waste": a.resident_waste, "hits": a.hits},
           "machine": wrap_results.machine(), "results": []}
    tmp = tempfile.mkdtemp(prefix="dd-gpu-decode-modes-", dir=a.tmp)
    failed = False
    try:
        with open(os.path.join(a.out_dir, "gpu-decode-modes.log"), "w") as log:
            model = os.path.join(tmp, p["shape"] + ".gguf")
            err = synth_model(a, p["shape"], model, log, WHO)
            for spec in p["runs"]:
                if spec.get("cuda_only") and a.device != "cuda":
                    continue
                res = {"context": spec["context"], "error": err} if err else bench_context(a, p, spec, model, tmp, log)
                doc["results"].append(res)
                failed |= "error" in res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["gather"] = gather_figures(a.out_dir)
    doc["targets"] = analyse(doc)
    write_outputs(a.out_dir, "gpu-decode-modes", doc, summary(doc))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
