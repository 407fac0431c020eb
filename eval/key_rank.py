#!/usr/bin/env python3
"""The low-rank key cache's rank against its loss (docs/decisions/0052-low-rank-key-reconstruction.md):
teacher-forced KL(full ‖ sparse with every sparse layer's keys rebuilt at rank r) on the
standard texts, beside the same sparse run with its keys fetched (rank 0), one `ddctl fidelity
--key_ranks` process per context (full runs once), and the resident bytes each rank keeps per
position and sparse layer against the keys' own.

  python3 eval/key_rank.py [--model smollm2] [--ranks 0,32,64,...] [--contexts 8192]
      -> bench/results/eval-key-rank[-MODEL].{json,md}
"""
import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cli import Ddctl, EngineSetupError  # noqa: E402
from fidelity import _summary, fidelity_lines  # noqa: E402
import haystack  # noqa: E402
import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--ddctl")
    ap.add_argument("--ranks", help="comma-separated; 0 = keys fetched (default: by the model's key width)")
    ap.add_argument("--contexts", help="comma-separated (default 8192; SmolLM2 4096)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--score-tokens", type=int, default=128)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    try:
        eng = Ddctl(a.ddctl, a.model)
    except EngineSetupError as e:
        sys.exit(f"key_rank: {e}")
    info = eng.info()
    kv_dim = info["n_head_kv"] * info["head_dim"]
    short = models.short_name(a.model)
    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else \
        [0] + [r for r in (kv_dim // 8, kv_dim // 4, kv_dim * 3 // 8, kv_dim // 2, kv_dim * 3 // 4, kv_dim) if r % 8 == 0]
    if any(r < 0 or r > kv_dim for r in ranks):
        ap.error(f"every rank must be in [0, {kv_dim}] (0 = keys fetched), got {ranks}")
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else [4096 if short == "smollm2" else 8192]
    texts = [haystack.license_path(n) for n in haystack.HAYSTACK_FILES]
    runs, t0 = [], time.time()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write("\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in texts))
        f.flush()
        for ctx in contexts:
            lines = fidelity_lines(eng, f.name, ctx, a.score_tokens,
                                   ["--budget", str(a.budget), "--key_ranks", ",".join(map(str, ranks))])
            for r, j in zip(ranks, lines):
                runs.append({"context": ctx, "rank": r, "budget_tokens": j["budget_tokens"], "scored": j["scored"],
                             "ppl_full": j["ppl_full"], "ppl": j["ppl_sparse"],
                             # per position and sparse layer: f32 coefficients, against f32 / f16 keys
                             "coefficient_bytes": 4 * r, "key_bytes_f32": 4 * kv_dim, "key_bytes_f16": 2 * kv_dim,
                             **_summary(j)})
                print(f"key_rank: context {ctx} rank {r}: KL mean {j['kl_mean']:.4f} ({(time.time() - t0) / 60:.1f} min)",
                      file=sys.stderr)
    sys.path.insert(0, str(ROOT / "bench"))
    import wrap_results  # git_sha()
    stem = "eval-key-rank" + ("" if short == "gemma" else "-" + short)
    doc = {"benchmark": stem, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "command": "python3 eval/key_rank.py " + " ".join(sys.argv[1:]),
           "model": short, "kv_dim": kv_dim, "texts": texts, "runs": runs, "wall_s": round(time.time() - t0, 1)}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# Low-rank key cache: rank against loss ({short}, keys {kv_dim} wide)", "",
          f"Sparse (budget {a.budget}) with every sparse layer's keys rebuilt at each rank, against full attention, "
          f"teacher-forced over {a.score_tokens} positions (rank 0: keys fetched). KL(full ‖ run) in nats per "
          "position; resident bytes per position and sparse layer (f32 coefficients) against the keys' own.", "",
          f"git {doc['git_sha'][:12]}, command `{doc['command']}`, {doc['wall_s'] / 60:.1f} min.", "",
          "| context | rank | KL mean | KL p50 | KL p90 | KL max | ppl | ppl full | bytes / key bytes (f16) |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        share = f"{r['coefficient_bytes'] / r['key_bytes_f16']:.2f}" if r["rank"] else "—"
        md.append(f"| {r['context']} | {r['rank'] or 'fetched'} | {r['kl_mean']:.4f} | {r['kl_p50']:.4f} | "
                  f"{r['kl_p90']:.4f} | {r['kl_max']:.4f} | {r['ppl']:.2f} | {r['ppl_full']:.2f} | {share} |")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"key_rank: wrote {out / (stem + '.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
