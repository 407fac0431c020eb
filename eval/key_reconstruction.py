#!/usr/bin/env python3
"""Key reconstruction, online against offline (docs/decisions/0052-low-rank-key-reconstruction.md):
where some sparse layer's next-step hit rate is below 85%, dualdecoder with the keys of poorly
predicted layers rebuilt from the low-rank key cache instead of fetched, chosen

  off      never (exact sparse attention, the reference of the other runs' bytes);
  auto     online, per layer, from the hit rate measured while decoding (the default policy);
  offline  the paper's way: the layers whose hit rate was below 85% in a profiling run on
           other texts (the license texts in reverse order, the test's in order), every step
           (`--reconstruct_layers`);
  all      every sparse layer, every step (the loss's upper end).

Profiling: one greedy `ddctl generate --mode dualdecoder` on the profiling text, per-layer hit
rates. Measurement: one `ddctl fidelity --mode dualdecoder --key_reconstructions ...` process per
context on the test texts (full runs once): KL(full ‖ run) per teacher-forced position, the
urgent and prefetched bytes, the chunks whose keys were rebuilt, and the hit rate.

  python3 eval/key_reconstruction.py [--model smollm2] [--budget 256] [--contexts 7600]
      -> bench/results/eval-key-reconstruction[-MODEL].{json,md}
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
from fidelity import _summary, fidelity_lines  # noqa: E402
import haystack  # noqa: E402
import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = 0.85


def profile(eng, words, ctx, budget, steps):
    """Per-layer hit rates of one greedy dualdecoder generation at about `ctx` tokens of `words`."""
    n = eng.count_tokens(words)
    # The first ctx tokens' worth of text: cut by the tokens' share of the characters.
    cut = words[: int(len(words) * min(1.0, ctx / max(1, n)))]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(cut)
        f.flush()
        r = subprocess.run([str(eng.exe), "generate", "--model", str(eng.model), "--prompt_file", f.name,
                            "--mode", "dualdecoder", "--budget", str(budget), "--max_new_tokens", str(steps),
                            "--ignore_eos", "--json"], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"key_reconstruction: profiling failed: {r.stderr.strip()[-500:]}")
    j = json.loads(r.stdout)
    return j["prompt_tokens"], {int(l["layer"]): l["hit_rate_after_first"] for l in j["per_layer"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--ddctl")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--contexts", help="comma-separated (default 7600: SmolLM2's texts where hit rates dip)")
    ap.add_argument("--score-tokens", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=64)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    try:
        eng = Ddctl(a.ddctl, a.model)
    except EngineSetupError as e:
        sys.exit(f"key_reconstruction: {e}")
    short = models.short_name(a.model)
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else [7600]
    texts = [haystack.license_path(n) for n in haystack.HAYSTACK_FILES]
    read = lambda ps: "\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in ps)  # noqa: E731
    profile_words = read(reversed(texts))  # other texts first: BSD, LGPL-3, GPL-1, ...
    runs, profiles, t0 = [], [], time.time()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(read(texts))
        f.flush()
        for ctx in contexts:
            tokens, rates = profile(eng, profile_words, ctx, a.budget, a.profile_steps)
            offline = sorted(l for l, h in rates.items() if h < THRESHOLD)
            profiles.append({"context": ctx, "profile_prompt_tokens": tokens, "hit_rates": rates, "offline_layers": offline})
            print(f"key_reconstruction: profile at {tokens} tokens: {len(offline)} of {len(rates)} layers below "
                  f"{THRESHOLD:.0%}: {offline} ({(time.time() - t0) / 60:.1f} min)", file=sys.stderr)
            variants = [("off", "off"), ("auto", "auto"), ("all", "all")]
            if offline:
                variants.insert(2, ("offline", "layers:" + "+".join(map(str, offline))))
            lines = fidelity_lines(eng, f.name, ctx, a.score_tokens,
                                   ["--mode", "dualdecoder", "--budget", str(a.budget),
                                    "--key_reconstructions", ",".join(v for _, v in variants)])
            for (name, _), j in zip(variants, lines):
                runs.append({"context": ctx, "policy": name, "budget_tokens": j["budget_tokens"],
                             "scored": j["scored"], "ppl_full": j["ppl_full"], "ppl": j["ppl_sparse"],
                             "hit_rate": j["hit_rate"], "urgent_bytes": j["urgent_bytes"],
                             "prefetch_bytes": j["prefetch_bytes"], "selected_chunks": j["selected_chunks"],
                             "reconstructed_chunks": j["reconstructed_chunks"],
                             "reconstruct_layers": j.get("reconstruct_layers", []), "key_rank": j.get("key_rank"),
                             **_summary(j)})
                print(f"key_reconstruction: {ctx} {name}: KL {j['kl_mean']:.4f}, urgent {j['urgent_bytes'] / 2**20:.1f} "
                      f"MiB, rebuilt {j['reconstructed_chunks']} of {j['selected_chunks']}", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "bench"))
    import wrap_results  # git_sha()
    stem = "eval-key-reconstruction" + ("" if short == "gemma" else "-" + short)
    doc = {"benchmark": stem, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "command": "python3 eval/key_reconstruction.py " + " ".join(sys.argv[1:]),
           "model": short, "threshold": THRESHOLD, "profile_texts": list(reversed(texts)), "texts": texts,
           "profiles": profiles, "runs": runs, "wall_s": round(time.time() - t0, 1)}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# Key reconstruction, online (auto) against offline profiling ({short}, budget {a.budget})", "",
          f"dualdecoder, teacher-forced over {a.score_tokens} positions; KL(full ‖ run) in nats per position. "
          f"`offline`: the layers below {THRESHOLD:.0%} hit rate in a profiling run on the license texts in "
          "reverse order (the test's are in order).",
          "", f"git {doc['git_sha'][:12]}, command `{doc['command']}`, {doc['wall_s'] / 60:.1f} min.", ""]
    for p in profiles:
        md.append(f"Profile at {p['profile_prompt_tokens']} tokens: layers below {THRESHOLD:.0%}: "
                  f"{p['offline_layers'] or 'none'} (lowest {min(p['hit_rates'].values()):.1%}).")
    md += ["", "| context | policy | KL mean | KL p90 | ppl | ppl full | hit rate | urgent MiB | prefetch MiB | "
           "keys rebuilt |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        share = r["reconstructed_chunks"] / max(1, r["selected_chunks"])
        md.append(f"| {r['context']} | {r['policy']} | {r['kl_mean']:.4f} | {r['kl_p90']:.4f} | {r['ppl']:.2f} | "
                  f"{r['ppl_full']:.2f} | {r['hit_rate']:.1%} | {r['urgent_bytes'] / 2**20:.1f} | "
                  f"{r['prefetch_bytes'] / 2**20:.1f} | {share:.0%} |")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"key_reconstruction: wrote {out / (stem + '.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
