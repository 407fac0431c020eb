"""Before vs after, side by side: dd-bench-modes built at two commits of main, run in alternating
turns on the same workload, per (model, mode, batch, link) the ratio after / before of decode
tokens/s in each turn (median and range over the turns, so a slow spell of a shared machine falls
on both alike).

  python3 bench/ab_commits.py --before SHA --after SHA --name NAME [--turns 3] -- BENCH-ARGS...
  e.g. python3 bench/ab_commits.py --before 8a7c2e6 --after HEAD --name batch-wide-attention \\
         -- --contexts 4096 --batches 1,4 --steps 12 --stores inproc --modes sparse,sparse-cached,dualdecoder

dd-bench-modes takes the engine's flags (decode-worker/service/engine_flags.h) since 2026-12-07, with
the engine's defaults (budget 2048, device auto, no device-memory budget); commits before that
had their own (budget 1024, device cpu, 1 GiB). To compare across that change, pass all three:
--budget 1024 --device cpu --device_memory 1GiB.

Each commit is checked out in a worktree and built (dd-bench-modes only) under
~/.cache/dualdecoder/ab/<sha>. Both models run (gemma, smollm2). Writes bench/results/NAME.json
and NAME.md; refuses a dirty work tree or a commit that is not on main.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from wrap_results import machine  # noqa: E402

sys.path.insert(0, str(REPO / "eval"))
from models import model_path  # noqa: E402

CACHE = Path(os.environ.get("DD_AB_CACHE", Path.home() / ".cache" / "dualdecoder" / "ab"))


def git(*args, cwd=REPO):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev):
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if subprocess.run(["git", "merge-base", "--is-ancestor", sha, "main"], cwd=REPO).returncode != 0:
        sys.exit(f"ab_commits: {rev} ({sha[:12]}) is not a commit on main")
    return sha


def build(sha):
    tree = CACHE / sha[:12]
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), sha], cwd=REPO, check=True,
                       capture_output=True)
    print(f"ab_commits: building dd-bench-modes at {sha[:12]}", file=sys.stderr, flush=True)
    env = dict(os.environ, DD_TARGETS="dd-bench-modes", DD_WERROR="OFF")
    subprocess.run([str(tree / "scripts" / "build")], cwd=tree, env=env, check=True)
    return tree / "build" / "bin" / "dd-bench-modes"


def run(binary, model, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        subprocess.run([str(binary), "--model", model, "--out", str(out), *args], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def key(r):
    return (r["mode"], r["batch"], r["link"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--models", default="gemma,smollm2")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.bench_args if x != "--"]
    if a.turns < 1:
        sys.exit("ab_commits: --turns must be >= 1")
    if git("status", "--porcelain", "--untracked-files=no"):
        sys.exit("ab_commits: the work tree has uncommitted changes; commit first (results record clean shas)")
    before, after = resolve(a.before), resolve(a.after)
    binaries = {"before": build(before), "after": build(after)}
    models = {}
    for m in a.models.split(","):
        turns = []
        for t in range(a.turns):
            turn = {}
            # Alternate which goes first, so neither always follows the other's heat.
            order = ("before", "after") if t % 2 == 0 else ("after", "before")
            for side in order:
                print(f"ab_commits: {m} turn {t + 1}/{a.turns}: {side}", file=sys.stderr, flush=True)
                turn[side] = run(binaries[side], str(model_path(m)), args)
            turns.append(turn)
        rows = []
        for r in turns[0]["after"]["runs"]:
            k = key(r)
            ratios, tps = [], {"before": [], "after": []}
            for turn in turns:
                side = {s: next(x for x in turn[s]["runs"] if key(x) == k) for s in ("before", "after")}
                for s in tps:
                    tps[s].append(side[s]["tokens_per_s"])
                ratios.append(side["after"]["tokens_per_s"] / side["before"]["tokens_per_s"])
            rows.append({"mode": k[0], "batch": k[1], "link": k[2], "ratio_median": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "before_tokens_per_s": tps["before"], "after_tokens_per_s": tps["after"]})
        models[m] = {"model": turns[0]["after"].get("model", m), "rows": rows}
    doc = {"benchmark": "ab-commits", "preset": a.name,
           "command": " ".join(["python3", "bench/ab_commits.py", *sys.argv[1:]]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "git_sha": after,
           "before_sha": before, "after_sha": after, "turns": a.turns, "bench_args": args, "machine": machine(),
           "results": models}
    out = REPO / "bench" / "results" / f"{a.name}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# {a.name}: {after[:12]} against {before[:12]}", "",
             f"dd-bench-modes at both commits in {a.turns} alternating turns on {doc['machine']['cpu']} "
             f"({doc['machine']['cores']} cores), {doc['date']}: `{doc['command']}`. Ratio = after / before "
             "decode tokens/s in the same turn; median (min-max) over the turns.", ""]
    for m, res in models.items():
        lines += [f"## {res['model']}", "", "| mode | batch | link | after / before | before tok/s | after tok/s |",
                  "|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['mode']} | {r['batch']} | {r['link']} | {r['ratio_median']:.2f} "
                         f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
                         f"{statistics.median(r['before_tokens_per_s']):.1f} | "
                         f"{statistics.median(r['after_tokens_per_s']):.1f} |")
        lines.append("")
    (REPO / "bench" / "results" / f"{a.name}.md").write_text("\n".join(lines))
    print(f"ab_commits: wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
