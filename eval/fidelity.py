#!/usr/bin/env python3
"""Fidelity without tasks (issue 4, DESIGN §10): on long natural text, `ddctl fidelity`
teacher-forces the same tokens through `full` and `sparse` side by side and reports, per
position, KL(full || sparse) of the next-token distributions, plus teacher-forced perplexity
of each. dualdecoder's real rows are bit-identical to sparse (tested), so sparse stands for both.

  python3 eval/fidelity.py [--quick|--full]  -> bench/results/eval-fidelity.{json,md}
"""
import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cli import Ddctl, EngineSetupError  # noqa: E402
import haystack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = list(haystack.NATURAL_TEXTS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="contexts 2048, 4096, 8192 (default)")
    g.add_argument("--full", action="store_true", help="contexts 2048 ... 16384")
    ap.add_argument("--score-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="512,1024,2048")
    ap.add_argument("--ddctl")
    ap.add_argument("--model")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets must be comma-separated integers, got {a.budgets!r}")
    if any(b <= 0 or b % 8 for b in budgets):
        ap.error(f"every budget must be a positive multiple of 8, got {budgets}")
    contexts = [2048, 4096, 8192, 16384] if a.full else [2048, 4096, 8192]
    for p in TEXTS:
        if not Path(p).is_file():
            sys.exit(f"fidelity: text {p} is missing (Debian package base-files)")
    try:
        eng = Ddctl(a.ddctl, a.model)
    except EngineSetupError as e:
        sys.exit(f"fidelity: {e}")
    runs, t0 = [], time.time()
    pairs = [(c, b) for c in contexts for b in budgets if b < c]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write("\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in TEXTS))
        f.flush()
        for i, (ctx, budget) in enumerate(pairs):
            r = subprocess.run([str(eng.exe), "fidelity", "--model", str(eng.model), "--prompt_file", f.name,
                                "--context", str(ctx), "--score_tokens", str(a.score_tokens), "--mode", "sparse",
                                "--budget", str(budget)], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"fidelity: ddctl fidelity failed: {r.stderr.strip()[-500:]}")
            j = json.loads(r.stdout)
            runs.append({k: j[k] for k in ("context", "budget_tokens", "scored", "kl_mean", "kl_max", "ppl_full",
                                           "ppl_sparse")})
            print(f"fidelity: [{i + 1}/{len(pairs)}] context {ctx} budget {budget}: KL mean {j['kl_mean']:.4f} max "
                  f"{j['kl_max']:.4f}, ppl {j['ppl_full']:.2f} full vs {j['ppl_sparse']:.2f} sparse "
                  f"({(time.time() - t0) / 60:.1f} min)", file=sys.stderr)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "eval-fidelity", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "score_tokens": a.score_tokens, "texts": TEXTS, "runs": runs}
    (out / "eval-fidelity.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# Sparse vs full without tasks: teacher-forced KL and perplexity ({a.score_tokens} positions)", "",
          "The license texts one after another; the first `context` tokens are prefilled, the next positions are "
          "teacher-forced through both engines in one `ddctl fidelity` process. KL(full ‖ sparse) in nats per "
          "position.", "",
          "| context | budget | KL mean | KL max | ppl full | ppl sparse |", "|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        md.append(f"| {r['context']} | {r['budget_tokens']} | {r['kl_mean']:.4f} | {r['kl_max']:.4f} | "
                  f"{r['ppl_full']:.2f} | {r['ppl_sparse']:.2f} |")
    (out / "eval-fidelity.md").write_text("\n".join(md) + "\n")
    print(f"fidelity: wrote {out / 'eval-fidelity.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
