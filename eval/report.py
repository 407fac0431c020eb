"""Aggregates per-task records into bench/results/eval-tasks.{json,md} and two plots.

Records are the dicts run.py writes (one per task x mode x budget). Conditions are named
"full", "sparse@B" and "dualdecoder@B".
"""
import collections
import json
import os

GOAL_BUDGET = 2048
GOAL_POINTS = 0.02
FULL_MIN = 0.5


def condition(r):
    return "full" if r["mode"] == "full" else f"{r['mode']}@{r['budget']}"


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def accuracy_rows(records):
    groups = collections.defaultdict(list)
    for r in records:
        for family in (r["family"], "all"):
            groups[(family, r["length"], r["mode"], r["budget"] or 0)].append(bool(r["correct"]))
    return [{"family": f, "length": n, "mode": m, "budget": b or None, "n": len(v), "correct": sum(v),
             "accuracy": sum(v) / len(v)} for (f, n, m, b), v in sorted(groups.items())]


def dual_vs_sparse(records):
    """Dualdecoder must produce exactly sparse's tokens (real rows are bit-identical to sparse:
    docs/decisions/0008-dual-token-step.md)."""
    by_key = {(r["task_id"], r["mode"], r["budget"]): r for r in records}
    compared, mismatches = 0, []
    for (task_id, mode, budget), d in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        s = by_key.get((task_id, "sparse", budget))
        if mode != "dualdecoder" or s is None:
            continue
        compared += 1
        if d["tokens"] != s["tokens"]:
            mismatches.append({"task_id": task_id, "budget": budget, "sparse": s["answer"], "dualdecoder": d["answer"]})
    return {"compared": compared, "equal": compared - len(mismatches), "mismatches": mismatches}


def hit_rates(records):
    dual = [r for r in records if r["mode"] == "dualdecoder" and r.get("hit_rate") is not None]
    layers = collections.defaultdict(list)
    layers_by_length = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in dual:
        for entry in r.get("per_layer") or []:
            layers[entry["layer"]].append(entry["hit_rate"])
            layers_by_length[r["length"]][entry["layer"]].append(entry["hit_rate"])

    def by(field):
        groups = collections.defaultdict(list)
        for r in dual:
            groups[r[field]].append(r["hit_rate"])
        return {str(k): _mean(v) for k, v in sorted(groups.items())}

    return {"mean": _mean(r["hit_rate"] for r in dual), "n": len(dual),
            "per_layer": {str(k): _mean(v) for k, v in sorted(layers.items())},
            "per_layer_by_length": {str(n): {str(k): _mean(v) for k, v in sorted(ls.items())}
                                    for n, ls in sorted(layers_by_length.items())},
            "per_family": by("family"), "per_length": by("length"), "per_budget": by("budget")}


def goal_check(records):
    """Per family: full >= 50%? then sparse@2048 within 2 points of full on the same tasks."""
    out = []
    for family in sorted({r["family"] for r in records}):
        sparse = {r["task_id"]: r["correct"] for r in records
                  if r["family"] == family and r["mode"] == "sparse" and r["budget"] == GOAL_BUDGET}
        full = {r["task_id"]: r["correct"] for r in records
                if r["family"] == family and r["mode"] == "full" and r["task_id"] in sparse}
        tasks = sorted(set(sparse) & set(full))
        row = {"family": family, "n": len(tasks)}
        if not tasks:
            row["verdict"] = f"not run (no task with sparse@{GOAL_BUDGET})"
        else:
            row["full"] = sum(full[t] for t in tasks) / len(tasks)
            row["sparse"] = sum(sparse[t] for t in tasks) / len(tasks)
            if row["full"] < FULL_MIN:
                row["verdict"] = "n/a (full < 50%)"
            else:
                row["verdict"] = "met" if row["sparse"] >= row["full"] - GOAL_POINTS else "missed"
        out.append(row)
    return out


def aggregate(records):
    return {"accuracy": accuracy_rows(records), "dual_vs_sparse": dual_vs_sparse(records),
            "hit_rate": hit_rates(records), "goal": goal_check(records)}


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def _cell(rows, family, length, mode, budget):
    for r in rows:
        if (r["family"], r["length"], r["mode"], r["budget"]) == (family, length, mode, budget):
            return f"{_pct(r['accuracy'])} ({r['correct']}/{r['n']})"
    return "–"


def markdown(doc, plots):
    res, cfg = doc["results"], doc["config"]
    acc = res["accuracy"]
    families = [f for f in cfg["families"]] + ["all"]
    lengths = cfg["lengths"]
    budgets = cfg["budgets"]
    lines = [f"# Long-context task accuracy ({doc['preset']})", "",
             f"{cfg['model']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores), git "
             f"{doc['git_sha'][:12]}, {doc['date'][:16]}. {cfg['tasks']} tasks ({cfg['per_family']} per family and "
             f"length, seed {cfg['seed']}), {cfg['runs']} generations, {cfg['wall_s'] / 60:.1f} min of generation. Greedy "
             "decoding through `ddctl generate --json`; exact-match scoring (eval/README.md).", "",
             "## Full attention (read this first)", "",
             "A family the model fails with full attention says nothing about sparsity.", "",
             "| family | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for f in families:
        lines.append(f"| {f} | " + " | ".join(_cell(acc, f, n, "full", None) for n in lengths) + " |")
    lines += ["", "## Sparse and dualdecoder against full", "",
              "Pairs with budget ≥ length are not run (the budget would cover the whole prompt).", "",
              "| family | length | budget | full | sparse | dualdecoder |", "|---|---:|---:|---:|---:|---:|"]
    for f in families:
        for n in lengths:
            for b in budgets:
                if b < n:
                    lines.append(f"| {f} | {n} | {b} | {_cell(acc, f, n, 'full', None)} | "
                                 f"{_cell(acc, f, n, 'sparse', b)} | {_cell(acc, f, n, 'dualdecoder', b)} |")
    lines += ["", f"## Goal: sparse@{GOAL_BUDGET} within {GOAL_POINTS * 100:.0f} points of full "
              f"(families where full ≥ {FULL_MIN:.0%})", "",
              "Same tasks on both sides (every length where the budget ran). With a few tasks per family one "
              "task moves accuracy by many points: read the counts.", "",
              "| family | tasks | full | sparse | verdict |", "|---|---:|---:|---:|---|"]
    for g in res["goal"]:
        lines.append(f"| {g['family']} | {g['n']} | {_pct(g.get('full'))} | {_pct(g.get('sparse'))} | {g['verdict']} |")
    ds = res["dual_vs_sparse"]
    lines += ["", "## dualdecoder == sparse", "",
              f"Generated tokens equal in {ds['equal']} of {ds['compared']} (task, budget) pairs."]
    for m in ds["mismatches"]:
        lines.append(f"- MISMATCH {m['task_id']} @{m['budget']}: sparse {m['sparse']!r}, dualdecoder {m['dualdecoder']!r}")
    hr = res["hit_rate"]
    if hr["n"]:
        lines += ["", "## Prefetch hit rate (dualdecoder)", "",
                  f"Mean {_pct(hr['mean'])} over {hr['n']} generations. Answers are short (a few to ~40 tokens) "
                  "and the first decode step is seeded by pre-decoding (a 100% hit by construction, "
                  "docs/decisions/0008-dual-token-step.md), so these rates lean high.", "",
                  "| by | " + " | ".join(["length " + k for k in hr["per_length"]] + ["budget " + k for k in hr["per_budget"]]) + " |",
                  "|---|" + "---:|" * (len(hr["per_length"]) + len(hr["per_budget"])),
                  "| hit rate | " + " | ".join(_pct(v) for v in list(hr["per_length"].values()) + list(hr["per_budget"].values())) + " |",
                  "", "| family | " + " | ".join(hr["per_family"]) + " |", "|---|" + "---:|" * len(hr["per_family"]),
                  "| hit rate | " + " | ".join(_pct(v) for v in hr["per_family"].values()) + " |",
                  "", "Per sparse layer: " + ", ".join(f"{k}: {_pct(v)}" for k, v in hr["per_layer"].items()) + "."]
    lines.append("")
    lines += [f"![{alt}]({name})" for alt, name in plots]
    return "\n".join(lines) + "\n"


def plot(doc, out_dir, name):
    """Writes the PNGs; returns [(alt text, file name)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res, cfg = doc["results"], doc["config"]
    made = []
    rows = [r for r in res["accuracy"] if r["family"] == "all"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for cond in ["full"] + [f"{m}@{b}" for m in ("sparse", "dualdecoder") for b in cfg["budgets"]]:
        pts = sorted((r["length"], r["accuracy"]) for r in rows
                     if condition({"mode": r["mode"], "budget": r["budget"]}) == cond)
        if pts:
            style = {"full": ("o", "-", 9), "sparse": ("s", "-", 6), "dualdecoder": ("x", "--", 8)}[cond.split("@")[0]]
            ax.plot(*zip(*pts), marker=style[0], linestyle=style[1], markersize=style[2], label=cond)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["lengths"], [str(n) for n in cfg["lengths"]])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("accuracy (all families)")
    ax.set_title("Task accuracy vs length per mode")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}-accuracy.png"), dpi=100)
    plt.close(fig)
    made.append(("accuracy vs length", f"{name}-accuracy.png"))
    by_length = res["hit_rate"]["per_layer_by_length"]
    if by_length:
        fig, ax = plt.subplots(figsize=(7, 4))
        layer_ids = sorted({int(k) for ls in by_length.values() for k in ls})
        slot = {layer: i for i, layer in enumerate(layer_ids)}   # one slot per sparse layer
        width = 0.8 / len(by_length)
        for i, (n, layers) in enumerate(by_length.items()):
            ax.bar([slot[int(k)] + (i - (len(by_length) - 1) / 2) * width for k in layers], list(layers.values()),
                   width=width, label=f"{n} tokens")
        ax.set_xticks(range(len(layer_ids)), [str(x) for x in layer_ids])
        ax.set_xlabel("layer (sparse layers only)")
        ax.set_ylabel("mean prefetch hit rate")
        ax.set_ylim(0, 1.05)
        ax.set_title("dualdecoder hit rate per layer, all budgets and families")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}-hit-rate.png"), dpi=100)
        plt.close(fig)
        made.append(("hit rate per layer", f"{name}-hit-rate.png"))
    return made


def write(doc, out_dir, name="eval-tasks"):
    """Writes <name>.json, <name>.md and the plots into out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(path + ".tmp", path)
    plots = plot(doc, out_dir, name)
    md = os.path.join(out_dir, f"{name}.md")
    with open(md, "w") as f:
        f.write(markdown(doc, plots))
    return [path, md] + [os.path.join(out_dir, p) for _, p in plots]
