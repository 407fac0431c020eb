"""Report of the standard evaluation (eval/standard.py): full-attention accuracy first, then the
paired sparse-minus-full differences with intervals, then a verdict per budget.

Writes bench/results/eval-standard.json and eval-standard.md (or -quick when the preset is quick).
"""
import collections
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402

MIN_FULL = 0.5   # cells where full attention is below this say nothing about sparsity


def _by_question(rec):
    return {a["id"]: a for a in rec["answers"]}


def _split_by_family(records):
    """Records carry a haystack's answers, possibly of two families: one record per family."""
    out = []
    for r in records:
        fams = {}
        for a in r["answers"]:
            fams.setdefault(a.get("family") or r["family"], []).append(a)
        out += [dict(r, family=f, group=r["family"], answers=answers) for f, answers in fams.items()]
    return out


def aggregate(records):
    """Cells keyed by (model, family, length): full accuracy, per budget the sparse accuracy and
    the paired difference, continuation NLLs, the dualdecoder == sparse check, hit rates."""
    runs = collections.defaultdict(dict)   # (model, family, length) -> {(mode, budget): [records]}
    for r in _split_by_family(records):
        runs[(r["model"], r["family"], r["length"])].setdefault((r["mode"], r["budget"] or 0), []).append(r)
    cells, pooled = [], collections.defaultdict(lambda: collections.defaultdict(list))
    dual_checks, full_checks = [], []
    for (model, fam, length), by_mode in sorted(runs.items()):
        full_recs = {r["index"]: r for r in by_mode.get(("full", 0), [])}
        if not full_recs:
            continue
        full_answers = [a for r in full_recs.values() for a in r["answers"]]
        k = sum(a["correct"] for a in full_answers)
        lo, hi = stats.wilson(k, len(full_answers))
        cell = {"model": model, "family": fam, "length": length, "haystacks": len(full_recs),
                "full": {"n": len(full_answers), "correct": k, "accuracy": k / len(full_answers), "low": lo, "high": hi},
                "eligible": k / len(full_answers) >= MIN_FULL, "budgets": {}}
        if any("nll_true" in a for a in full_answers):
            cell["full"]["nll_mean"] = sum(a["nll_true"] for a in full_answers) / len(full_answers)
        for (mode, budget), recs in sorted(by_mode.items()):
            if mode != "sparse":
                continue
            acc_pairs, nll_pairs = collections.defaultdict(list), collections.defaultdict(list)
            n = right = 0
            for r in recs:
                base = full_recs.get(r["index"])
                if base is None:
                    continue
                f = _by_question(base)
                for a in r["answers"]:
                    if a["id"] not in f:
                        continue
                    n += 1
                    right += a["correct"]
                    acc_pairs[r["index"]].append((int(f[a["id"]]["correct"]), int(a["correct"])))
                    if "nll_true" in a:
                        nll_pairs[r["index"]].append((f[a["id"]]["nll_true"], a["nll_true"]))
            if n == 0:
                continue
            lo, hi = stats.wilson(right, n)
            d = stats.paired_difference(acc_pairs, binary=True)
            b = {"n": n, "correct": right, "accuracy": right / n, "low": lo, "high": hi, "diff": d,
                 "verdict": stats.verdict(d)}
            if nll_pairs:
                b["nll_diff"] = stats.paired_difference(nll_pairs)
            cell["budgets"][str(budget)] = b
            if cell["eligible"]:
                # Clustered by haystack: two families sharing one haystack share a cluster.
                group = recs[0].get("group", fam)
                for idx, pairs in acc_pairs.items():
                    pooled[(model, budget)][(group, length, idx)] += pairs
        for r in by_mode.get(("full-prefill", 0), []):
            f = full_recs.get(r["index"])
            if f is not None:
                fa = _by_question(f)
                same = sum(1 for a in r["answers"] if a["id"] in fa and a.get("tokens") == fa[a["id"]].get("tokens")
                           and a.get("choice_logprobs") == fa[a["id"]].get("choice_logprobs"))
                full_checks.append({"model": model, "family": fam, "length": length, "index": r["index"],
                                    "questions": len(r["answers"]), "same_as_full": same,
                                    "restored_tokens": f.get("prefix_reused_tokens") or 0})
        for (mode, budget), recs in by_mode.items():
            if mode != "dualdecoder":
                continue
            sparse = {r["index"]: r for r in by_mode.get(("sparse", budget), [])}
            for r in recs:
                s = sparse.get(r["index"])
                if s is None:
                    continue
                sa = _by_question(s)
                same = sum(1 for a in r["answers"] if a["id"] in sa and
                           a.get("tokens") == sa[a["id"]].get("tokens") and
                           a.get("choice_logprobs") == sa[a["id"]].get("choice_logprobs"))
                hits = [a["hit_rate_after_first"] for a in r["answers"] if "hit_rate_after_first" in a]
                dual_checks.append({"model": model, "family": fam, "length": length, "budget": budget,
                                    "index": r["index"], "questions": len(r["answers"]), "same_as_sparse": same,
                                    "hit_rate_after_first_mean": sum(hits) / len(hits) if hits else None})
        cells.append(cell)
    verdicts = []
    for (model, budget), clusters in sorted(pooled.items()):
        d = stats.paired_difference(clusters, binary=True)
        verdicts.append({"model": model, "budget": budget, "diff": d, "verdict": stats.verdict(d)})
    return {"cells": cells, "verdicts": verdicts, "dual_checks": dual_checks, "full_checks": full_checks}


def _pct(x):
    return f"{100 * x:.0f}%"


def _interval(lo, hi, scale=100, fmt="{:+.1f}"):
    if lo is None:
        return "–"
    return f"[{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]"


def markdown(doc):
    c, res = doc["config"], doc["results"]
    out = [f"# Evaluation with intervals ({c['preset']})", "",
           f"git {doc['git_sha'][:12]}, {doc['date'][:16]}, {doc['machine'].get('cpu', '?')} "
           f"({doc['machine'].get('cores', '?')} cores). Command: `{c['command']}`; runs recorded at "
           f"{', '.join(x[:12] for x in doc.get('record_shas', [])) or '?'}; {doc.get('wall_s', 0) / 60:.0f} min of runs. "
           f"{c['haystacks']} haystack(s) per (family, length), {c['questions_per_haystack']} questions each; "
           "each haystack prefilled once per mode and budget (`ddctl answer`), its sparse runs sharing a "
           "dd-kv-pool through prefix keys. Families: eval/README.md.", "",
           "## Full attention (read this first)", "",
           "A cell where full attention is below 50% says nothing about sparsity (marked –). Intervals: Wilson 95% "
           "per question (questions over one haystack are correlated: read them as optimistic).", "",
           "| model | family | length | questions | full accuracy | 95% interval |",
           "|---|---|---:|---:|---:|---|"]
    for cell in res["cells"]:
        f = cell["full"]
        out.append(f"| {cell['model']} | {cell['family']} | {cell['length']} | {f['n']} | {_pct(f['accuracy'])}"
                   f"{'' if cell['eligible'] else ' –'} | {_pct(f['low'])}–{_pct(f['high'])} |")
    out += ["", "## Sparse minus full, paired (same questions)", "",
            "Difference in accuracy points; 95% interval from a bootstrap over haystacks (10000 resamples). "
            "Verdict: \"no measurable loss\" when the interval includes 0 and stays above −5 points. "
            "The interval is at least ±3/n wide (rule of three: a bootstrap over identical answers gives [0, 0]).", "",
            "| model | family | length | budget | sparse | full | difference | 95% interval | verdict |",
            "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for cell in res["cells"]:
        for b, v in cell["budgets"].items():
            d = v["diff"]
            verdict = v["verdict"] if cell["eligible"] else "n/a (full < 50%)"
            out.append(f"| {cell['model']} | {cell['family']} | {cell['length']} | {b} | {_pct(v['accuracy'])} | "
                       f"{_pct(cell['full']['accuracy'])} | {100 * d['diff']:+.1f} | {_interval(d['low'], d['high'])} | "
                       f"{verdict} |")
    nll = [(cell, b, v) for cell in res["cells"] for b, v in cell["budgets"].items() if "nll_diff" in v]
    if nll:
        out += ["", "## Continuation: per-token NLL of the true continuation (nats), sparse minus full", "",
                "| model | length | budget | full NLL | difference | 95% interval |", "|---|---:|---:|---:|---:|---|"]
        for cell, b, v in nll:
            d = v["nll_diff"]
            out.append(f"| {cell['model']} | {cell['length']} | {b} | {cell['full']['nll_mean']:.3f} | "
                       f"{d['diff']:+.4f} | {_interval(d['low'], d['high'], 1, '{:+.4f}')} |")
    if res["dual_checks"]:
        same = sum(x["same_as_sparse"] for x in res["dual_checks"])
        total = sum(x["questions"] for x in res["dual_checks"])
        hits = [x["hit_rate_after_first_mean"] for x in res["dual_checks"] if x["hit_rate_after_first_mean"] is not None]
        out += ["", "## dualdecoder against sparse", "",
                f"dualdecoder gave the same tokens (and choice log-likelihoods) as sparse at the same budget on "
                f"{same} of {total} questions; mean prefetch hit rate (first step excluded) "
                f"{_pct(sum(hits) / len(hits)) if hits else '–'} on these task prompts (answers of a few tokens "
                "after a template cue: flattering, see eval-predictors.md for natural text)."]
    if res.get("full_checks"):
        same = sum(x["same_as_full"] for x in res["full_checks"])
        total = sum(x["questions"] for x in res["full_checks"])
        where = ", ".join(f"{x['model']} {x['family']} {x['length']} (restored {x['restored_tokens']} tokens)"
                          for x in res["full_checks"])
        out += ["", "## Restored full against prefilled full", "",
                "`full` restores the context a sparse run committed to the pool (the same KV bits as its own "
                f"prefill); a `full` run that prefilled its own context answered identically on {same} of {total} "
                f"questions ({where})."]
    out += ["", "## Verdict per budget", "",
            "All cells where full attention reaches 50%, pooled (paired, bootstrap over haystacks).", "",
            "| model | budget | questions | difference | 95% interval | verdict |", "|---|---:|---:|---:|---|---|"]
    for v in res["verdicts"]:
        d = v["diff"]
        out.append(f"| {v['model']} | {v['budget']} | {d['n']} | {100 * d['diff']:+.1f} | "
                   f"{_interval(d['low'], d['high'])} | **{v['verdict']}** |")
    out += time_table(doc)
    return "\n".join(out) + "\n"


def time_table(doc):
    """The preset's wall time, part by part: each model's task runs (the records' own times,
    wherever a resumed run recorded them) and the fidelity and predictor runs before them."""
    rows = [(f"tasks, {m}", s, ", ".join(x[:12] for x in shas)) for m, (s, shas) in sorted(doc.get("task_time", {}).items())]
    rows += [(p["part"], p["wall_s"], (p.get("git_sha") or "?")[:12]) for p in doc.get("parts", [])]
    if not rows:
        return []
    out = ["", "## Run time", "", "Wall time of each part on this machine's cores, as recorded (tasks: the sum of their "
           "runs' times). A part that shared the cores with other work reads high.", "",
           "| part | minutes | git |", "|---|---:|---|"]
    out += [f"| {name} | {secs / 60:.1f} | {sha} |" for name, secs, sha in rows]
    out.append(f"| **total** | **{sum(r[1] for r in rows) / 60:.1f}** | |")
    return out


def plot(doc, path):
    """Accuracy against length per (model, family): full and each sparse budget, Wilson bars;
    cells where full attention is below 50% drawn hollow."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = doc["results"]["cells"]
    panels = sorted({(c["model"], c["family"]) for c in cells})
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (model, fam) in zip(axes.flat, panels):
        mine = sorted((c for c in cells if (c["model"], c["family"]) == (model, fam)), key=lambda c: c["length"])
        series = {"full": [(c["length"], c["full"], c["eligible"]) for c in mine]}
        for c in mine:
            for b, v in c["budgets"].items():
                series.setdefault(f"sparse {b}", []).append((c["length"], v, c["eligible"]))
        for k, (name, pts) in enumerate(sorted(series.items(), key=lambda kv: (kv[0] != "full", len(kv[0]), kv[0]))):
            xs = [p[0] * (1 + 0.03 * k) for p in pts]
            ys = [p[1]["accuracy"] for p in pts]
            # max(0, .): at 100% the Wilson bound can round a hair below the accuracy.
            err = [[max(0.0, y - p[1]["low"]) for y, p in zip(ys, pts)],
                   [max(0.0, p[1]["high"] - y) for y, p in zip(ys, pts)]]
            line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name, linestyle="-")
            for x, y, p in zip(xs, ys, pts):
                if not p[2]:
                    ax.plot([x], [y], marker="o", markerfacecolor="white", color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{model}: {fam}", fontsize=9)
        ax.set_xlabel("prompt tokens", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(records, config, out_dir, parts=()):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import wrap_results  # machine() and git_sha(), shared with the other benchmarks
    doc = {"benchmark": "eval-standard", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "machine": wrap_results.machine(), "config": config,
           "wall_s": sum(r["wall_s"] for r in records), "runs": len(records),
           "record_shas": sorted({r.get("git_sha", "unknown") for r in records}), "results": aggregate(records),
           "parts": list(parts), "task_time": {}}
    for r in records:
        secs, shas = doc["task_time"].get(r["model"], (0.0, []))
        doc["task_time"][r["model"]] = (secs + r["wall_s"], sorted(set(shas) | {r.get("git_sha", "unknown")}))
    stem = "eval-standard" if config["preset"] == "standard" else f"eval-standard-{config['preset']}"
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, stem + ".json"), os.path.join(out_dir, stem + ".md")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    png = os.path.join(out_dir, stem + ".png")
    if plot(doc, png):
        paths.append(png)
    with open(paths[1], "w") as f:
        f.write(markdown(doc) + (f"\n![accuracy against length]({os.path.basename(png)})\n" if len(paths) > 2 else ""))
    return paths
