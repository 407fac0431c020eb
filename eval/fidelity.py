#!/usr/bin/env python3
"""Fidelity without tasks (eval/README.md, "Predictors and fidelity";
docs/decisions/0033-evaluation-methodology.md): on long natural text, `ddctl fidelity`
teacher-forces the same tokens through `full` and `sparse` side by side and reports, per
position, KL(full || sparse) of the next-token distributions, plus teacher-forced perplexity
of each. dualdecoder's real rows are bit-identical to sparse (tested), so sparse stands for both.

  python3 eval/fidelity.py [--quick|--full]  -> bench/results/eval-fidelity.{json,md}
  python3 eval/fidelity.py --standard [--model smollm2]
      contexts 8192, 16384, 32000 (SmolLM2: 2048, 4096, 8000 less the scored tokens), 128 scored
      positions, over every haystack text (enough tokens for 32K) -> eval-fidelity-standard[-MODEL].*
  python3 eval/fidelity.py --standard --kv-dtype f16 [--model smollm2]
      the KV type's loss (docs/decisions/0049-kv-storage-type.md): against full in f32, full in
      f16, and the sparse budget 1024 in f16 and in f32 -> eval-fidelity-kv-f16[-MODEL].*
The per-position KL is reported as its distribution (p50, p90, max), not only the mean.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cli import Ddctl, EngineSetupError  # noqa: E402
import haystack  # noqa: E402
import kv_pool  # noqa: E402
import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = list(haystack.NATURAL_TEXTS)


def _summary(j):
    kl = sorted(j["kl"])
    return {"kl_mean": j["kl_mean"], "kl_max": j["kl_max"], "kl_p50": kl[len(kl) // 2],
            "kl_p90": kl[min(len(kl) - 1, int(0.9 * len(kl)))], "kl": j["kl"]}


def fidelity_lines(eng, text_file, ctx, score_tokens, flags, env=None):
    """One `ddctl fidelity` process: full once, then each variant the flags name; one parsed
    JSON line per variant."""
    r = subprocess.run([str(eng.exe), "fidelity", "--model", str(eng.model), "--prompt_file", text_file,
                        "--context", str(ctx), "--score_tokens", str(score_tokens), "--mode", "sparse", *flags],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"fidelity: ddctl fidelity {' '.join(flags)} failed: {r.stderr.strip()[-500:]}")
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


def per_layer(a, eng, text_file):
    """KL with one global layer sparse at a time (the others dense): Gemma's global layers at
    8192, budget 1024; SmolLM2 every third layer and the last at 4096, budget 512. One process:
    full runs once for all layers."""
    layers = eng.info()["global_layers"]
    if len(layers) > 8:
        layers = sorted(set(layers[::3] + layers[-1:]))
    ctx, budget = (8192, 1024) if eng.context_length() > 16384 else (4096, 512)
    lines = fidelity_lines(eng, text_file, ctx, a.score_tokens,
                           ["--budget", str(budget), "--each_sparse_layer", ",".join(map(str, layers))])
    if [j.get("sparse_layers") for j in lines] != [[x] for x in layers]:
        sys.exit(f"fidelity: ddctl fidelity returned {len(lines)} layer runs for layers {layers}")
    out = []
    for layer, j in zip(layers, lines):
        out.append({"layer": layer, "context": ctx, "budget_tokens": budget, **_summary(j)})
        print(f"fidelity: layer {layer} alone: KL mean {out[-1]['kl_mean']:.4f}", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="contexts 2048, 4096, 8192 (default)")
    g.add_argument("--full", action="store_true", help="contexts 2048 ... 16384")
    g.add_argument("--standard", action="store_true", help="each model's long contexts, 128 positions")
    ap.add_argument("--score-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="512,1024,2048")
    ap.add_argument("--ddctl")
    ap.add_argument("--model")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--kv-dtype", choices=["f16"],
                    help="the KV type's loss instead of the budgets': full and sparse (budget 1024) in this type "
                         "and sparse in f32, each against full in f32")
    a = ap.parse_args()
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets must be comma-separated integers, got {a.budgets!r}")
    if any(b <= 0 or b % 8 for b in budgets):
        ap.error(f"every budget must be a positive multiple of 8, got {budgets}")
    contexts = [2048, 4096, 8192, 16384] if a.full else [2048, 4096, 8192]
    texts = TEXTS
    if a.standard:
        texts = [haystack.license_path(n) for n in haystack.HAYSTACK_FILES]
        a.score_tokens = 128 if a.score_tokens == 64 else a.score_tokens
        long_model = models.short_name(a.model) != "smollm2"
        contexts = [8192, 16384, 32000] if long_model else [2048, 4096, 8000 - a.score_tokens]
    for p in texts:
        if not Path(p).is_file():
            sys.exit(f"fidelity: text {p} is missing (Debian package base-files)")
    try:
        eng = Ddctl(a.ddctl, a.model)
    except EngineSetupError as e:
        sys.exit(f"fidelity: {e}")
    runs, t0 = [], time.time()
    # One process per context: full prefills and teacher-forces once, then each budget's sparse
    # engine; they share a dd-kv-pool, the first prefilling and committing the context, the
    # others restoring it.
    plan = [(c, [b for b in budgets if b < c]) for c in contexts]
    plan = [(c, bs) for c, bs in plan if bs]
    if a.kv_dtype:  # one reference (full, f32) per run: three runs per context
        kv = a.kv_dtype
        variants = [("full", kv, ["--mode", "full", "--kv_dtype", kv]),
                    ("sparse", kv, ["--budgets", "1024", "--kv_dtype", kv]),
                    ("sparse", "f32", ["--budgets", "1024", "--kv_dtype", "f32"])]
        kv_runs = []
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write("\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in texts))
            f.flush()
            for ctx in contexts:
                for mode, dtype, flags in variants:
                    (j,) = fidelity_lines(eng, f.name, ctx, a.score_tokens, [*flags, "--reference_kv_dtype", "f32"])
                    kv_runs.append({"context": ctx, "mode": mode, "kv_dtype": dtype,
                                    "budget_tokens": j["budget_tokens"] if mode == "sparse" else None,
                                    "scored": j["scored"], "ppl_full_f32": j["ppl_full"], "ppl": j["ppl_sparse"],
                                    **_summary(j)})
                    print(f"fidelity: context {ctx} {mode} {dtype}: KL mean {j['kl_mean']:.5f} max "
                          f"{j['kl_max']:.5f} ({(time.time() - t0) / 60:.1f} min)", file=sys.stderr)
        write_kv_report(a, kv, texts, kv_runs, t0)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f, \
            tempfile.TemporaryDirectory() as tmp:
        f.write("\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in texts))
        f.flush()
        env = dict(os.environ, DD_KV_POOL_TOKEN=kv_pool.POOL_TOKEN)
        have_pool = (eng.exe.parent / "dd-kv-pool").is_file()
        for i, (ctx, bs) in enumerate(plan):
            pool = kv_pool.Pool(eng.exe.parent, tmp) if have_pool and len(bs) > 1 else None
            try:
                lines = fidelity_lines(eng, f.name, ctx, a.score_tokens,
                                       ["--budgets", ",".join(map(str, bs)), *(pool.flags() if pool else [])], env)
            finally:
                if pool is not None:
                    pool.close()
            if [j["budget_tokens"] for j in lines] != bs:
                sys.exit(f"fidelity: ddctl fidelity returned budgets {[j['budget_tokens'] for j in lines]}, asked {bs}")
            for j in lines:
                run = {k: j[k] for k in ("context", "budget_tokens", "scored", "ppl_full", "ppl_sparse")}
                runs.append({**run, **_summary(j)})
                print(f"fidelity: [{i + 1}/{len(plan)}] context {ctx} budget {j['budget_tokens']}: KL mean "
                      f"{j['kl_mean']:.4f} max {j['kl_max']:.4f}, ppl {j['ppl_full']:.2f} full vs "
                      f"{j['ppl_sparse']:.2f} sparse ({(time.time() - t0) / 60:.1f} min)", file=sys.stderr)
        layer_runs = per_layer(a, eng, f.name) if a.standard else []
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "bench"))
    import wrap_results  # git_sha(), shared with the other benchmarks
    stem = "eval-fidelity"
    if a.standard:
        stem += "-standard" + ("" if models.short_name(a.model) == "gemma" else "-" + models.short_name(a.model))
    doc = {"benchmark": stem, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "command": "python3 eval/fidelity.py " + " ".join(sys.argv[1:]),
           "model": models.short_name(a.model), "score_tokens": a.score_tokens, "texts": texts, "runs": runs,
           "per_layer": layer_runs, "wall_s": round(time.time() - t0, 1)}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# Sparse vs full without tasks: teacher-forced KL and perplexity ({a.score_tokens} positions)", "",
          "The license texts one after another; the first `context` tokens are prefilled, the next positions are "
          "teacher-forced through both engines in one `ddctl fidelity` process. KL(full ‖ sparse) in nats per "
          "position.", "",
          f"Model {doc['model']}, git {doc['git_sha'][:12]}, command `{doc['command']}`, "
          f"{doc['wall_s'] / 60:.1f} min.", "",
          "| context | budget | KL mean | KL p50 | KL p90 | KL max | ppl full | ppl sparse |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        md.append(f"| {r['context']} | {r['budget_tokens']} | {r['kl_mean']:.4f} | {r['kl_p50']:.4f} | "
                  f"{r['kl_p90']:.4f} | {r['kl_max']:.4f} | {r['ppl_full']:.2f} | {r['ppl_sparse']:.2f} |")
    if layer_runs:
        r0 = layer_runs[0]
        md += ["", f"## One sparse layer at a time (context {r0['context']}, budget {r0['budget_tokens']})", "",
               "`--sparse_layers L`: layer L sparse, every other global layer attends over its whole KV; the loss "
               "that layer alone causes.", "",
               "| layer | KL mean | KL p50 | KL p90 | KL max |", "|---:|---:|---:|---:|---:|"]
        for r in layer_runs:
            md.append(f"| {r['layer']} | {r['kl_mean']:.4f} | {r['kl_p50']:.4f} | {r['kl_p90']:.4f} | {r['kl_max']:.4f} |")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"fidelity: wrote {out / (stem + '.json')}", file=sys.stderr)


def write_kv_report(a, kv, texts, runs, t0):
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "bench"))
    import wrap_results  # git_sha(), shared with the other benchmarks
    short = models.short_name(a.model)
    stem = f"eval-fidelity-kv-{kv}" + ("" if short == "gemma" else "-" + short)
    doc = {"benchmark": stem, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "command": "python3 eval/fidelity.py " + " ".join(sys.argv[1:]),
           "model": short, "score_tokens": a.score_tokens, "texts": texts, "runs": runs,
           "wall_s": round(time.time() - t0, 1)}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# The KV type's loss: teacher-forced KL against full attention in f32 ({a.score_tokens} positions)", "",
          "The license texts one after another; the first `context` tokens are prefilled, the next positions are "
          "teacher-forced through full attention with f32 KV and through the run named, in one `ddctl fidelity` "
          "process (`--reference_kv_dtype f32`). KL(full f32 ‖ run) in nats per position.", "",
          f"Model {doc['model']}, git {doc['git_sha'][:12]}, command `{doc['command']}`, "
          f"{doc['wall_s'] / 60:.1f} min.", "",
          "| context | run | KV | KL mean | KL p50 | KL p90 | KL max | ppl full f32 | ppl run |",
          "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        run = "full" if r["mode"] == "full" else f"sparse {r['budget_tokens']}"
        md.append(f"| {r['context']} | {run} | {r['kv_dtype']} | {r['kl_mean']:.5f} | {r['kl_p50']:.5f} | "
                  f"{r['kl_p90']:.5f} | {r['kl_max']:.5f} | {r['ppl_full_f32']:.3f} | {r['ppl']:.3f} |")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"fidelity: wrote {out / (stem + '.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
