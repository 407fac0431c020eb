"""Wraps a benchmark's raw JSON with config, machine and git sha, and writes a summary.

Usage: wrap_results.py --name model-cpu --preset quick --raw RAW.json --out-dir bench/results
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys


def paired(cells):
    """Whether a table row has any ratio: a batch only one mode ran (its max) pairs with none."""
    return any(c != "–" for c in cells)


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def git_sha():
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # Results files written by earlier benchmarks of the same run do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".", ":!bench/results"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary_model(doc):
    r = doc["results"]
    lines = [f"# CPU model benchmark ({doc['preset']})", "",
             f"{r['model']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores, "
             f"{r['threads']} threads), git {doc['git_sha'][:12]}, {doc['date']}", "",
             "| prefill prompt tokens | tokens/s |", "|---:|---:|"]
    for p in r["prefill"]:
        lines.append(f"| {p['prompt_tokens']} | {p['tokens_per_s']:.1f} |")
    lines += ["", "| decode context | batch | tokens/s | ms/step |", "|---:|---:|---:|---:|"]
    for d in r["decode"]:
        lines.append(f"| {d['context']} | {d['batch']} | {d['tokens_per_s']:.2f} | {d['step_ms']:.1f} |")
    lines += ["", f"Peak RSS: {r['peak_rss_mib']:.0f} MiB", ""]
    return "\n".join(lines)


def save_plot(doc, out_dir, alt, draw):
    """draw(pyplot) returns a figure; it is saved as <benchmark>.png next to the results.
    Returns the markdown lines that show it (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, doc["benchmark"] + ".png"), dpi=100)
    return [f"![{alt}]({doc['benchmark']}.png)"]


def summary_modes(doc, out_dir):
    r = doc["results"]
    runs = r["runs"]
    budget_mib = r.get("device_memory_bytes", 0) / 2**20
    lines = [f"# Decode modes ({doc['preset']})", "",
             f"{r['model']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores), git {doc['git_sha'][:12]}, "
             f"{doc['date']}. Every engine runs under a device-memory budget of {budget_mib:.0f} MiB. "
             f"pcie5-equivalent link calibrated in the run: {r['pcie5_equivalent_gbps']:.2f} GB/s "
             f"(one sparse layer's miss traffic under sparse-cached, one request, per layer of a sparse-cached "
             f"step's compute at batch 1). `sparse-cached` keeps chunks resident across steps and fetches the "
             f"misses (the paper's baseline); `dualdecoder` prefetches its prediction minus the resident chunks; "
             f"`dualdecoder-ring` is the cacheless dualdecoder (whole prediction into a ring each step)." +
             (f" Prefill runs on {r['threads']} compute threads, every timed decode step on {r['decode_threads']}"
              + (" (one core is left to the transfer thread or the pool process, as a GPU's copy engines do not "
                 "take its compute; docs/decisions/0032-benchmark-methodology.md)."
                 if r['decode_threads'] < r['threads'] else ".")
              if "decode_threads" in r else "") +
             (f" The modes of one store ran interleaved: at each link and batch every mode ran {r['rounds']} "
              f"turns of about {r['steps'] // r['rounds']} timed steps, taking turns, so a slow spell of this shared "
              "machine falls on every mode alike (the pool table gives each ratio's range over the turns)."
              if r.get("rounds", 1) > 1 else ""), "",
             "| mode | context | batch | link | tok/s | p50 ms | hit rate | wait ms/step | urgent MB/step | "
             "prefetch MB/step | reused | wasted MB | device MB/request | max batch |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in runs:
        reused = f"{x['reused_chunks'] / x['selected_chunks']:.0%}" if x.get("selected_chunks") else "–"
        lines.append(f"| {x['mode']} | {x['context']} | {x['batch']} | {x['link']} | {x['tokens_per_s']:.1f} | "
                     f"{x['step_ms_p50']:.1f} | {x['hit_rate']:.3f} | {x['wait_ms_per_step']:.2f} | "
                     f"{x['urgent_bytes_per_step'] / 1e6:.2f} | "
                     f"{x['prefetch_bytes_per_step'] / 1e6:.2f} | {reused} | "
                     f"{x['wasted_bytes'] / 1e6:.1f} | "
                     f"{x['device_bytes_per_request'] / 1e6:.1f} | {x['max_batch_in_budget']} |")
    mb = r.get("max_batch", [])
    if mb:
        lines += ["", f"Max batch under {budget_mib:.0f} MiB (MemoryPlan, leaving room for one request's prefill):", "",
                  "| context | full | sparse | sparse-cached | dualdecoder | sparse / full | sparse-cached / full | "
                  "dualdecoder / full |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for ctx in sorted({m["context"] for m in mb}):
            got = {m["mode"]: m["max_batch"] for m in mb if m["context"] == ctx}
            f = got.get("full", 0)
            ratio = (lambda v: f"{v / f:.1f}×" if f else "∞")
            sc = got.get("sparse-cached", 0)
            lines.append(f"| {ctx} | {f} | {got.get('sparse', 0)} | {sc} | {got.get('dualdecoder', 0)} | "
                         f"{ratio(got.get('sparse', 0))} | {ratio(sc)} | {ratio(got.get('dualdecoder', 0))} |")
    # Bytes moved per step (urgent + prefetch), infinite link: the step cache's saving.
    moved = {(x["mode"], x["context"], x["batch"]): x["urgent_bytes_per_step"] +
             x["prefetch_bytes_per_step"] for x in runs if x["link"] == "inmem"}
    brows = []
    for ctx, b in sorted({(c, b) for (m, c, b) in moved if m == "sparse"}):
        def r(a, z):
            va, vz = moved.get((a, ctx, b)), moved.get((z, ctx, b))
            return f"{va / 1e6:.2f} / {vz / 1e6:.2f} = {va / vz:.2f}×" if va is not None and vz else "–"
        cells = [r('sparse-cached', 'sparse'), r('dualdecoder', 'sparse')]
        if paired(cells):
            brows.append(f"| {ctx} | {b} | " + " | ".join(cells) + " |")
    if brows:
        lines += ["", "MB moved per step, infinite link (target ≤ 0.5× for both):", "",
                  "| context | batch | sparse-cached / sparse | dualdecoder / sparse |",
                  "|---:|---:|---|---|"] + brows
    # The carry (EngineOptions::spec_carry) against the same engine without it (--carry_ab).
    by_mode = {(x["mode"], x["context"], x["batch"], x["link"]): x for x in runs}
    crows = []
    for x in runs:
        if not x["mode"].endswith("-nocarry"):
            continue
        c = by_mode.get((x["mode"][:-len("-nocarry")], x["context"], x["batch"], x["link"]))
        if c:
            crows.append(f"| {c['mode']} | {x['context']} | {x['batch']} | {x['link']} | "
                         f"{c['tokens_per_s'] / x['tokens_per_s']:.2f}× | "
                         f"{x['step_ms_p50'] / c['step_ms_p50']:.2f}× | {c.get('carried_fraction', 0):.0%} |")
    if crows:
        lines += ["", "The carry: real rows whose token the last speculative row had start from its state after "
                  "the layers before the first sparse one (each mode against its `-nocarry` run, same "
                  "run):", "",
                  "| mode | context | batch | link | tok/s ratio | p50 speed-up | rows carried |",
                  "|---|---:|---:|---|---:|---:|---:|"] + crows
    # Targets: dualdecoder vs sparse on the pcie5 link, and dualdecoder pcie5 vs inmem.
    tput = {(x["mode"], x["context"], x["batch"], x["link"]): x["tokens_per_s"] for x in runs}
    p50_of = {(x["mode"], x["context"], x["batch"], x["link"]): x["step_ms_p50"] for x in runs}
    # dualdecoder over sparse on each slow path: the calibrated link model and the real pool
    # transports; and the calibrated link's throughput over the same mode's infinite link.
    slow = ["pcie5"] if any(x["link"] == "pcie5" for x in runs) else []
    slow += sorted({x["link"] for x in runs} - {"inmem", "pcie5"})  # pool transports (-xN: N transfer lanes)
    duals = [m for m in ("dualdecoder", "dualdecoder-fullhead", "dualdecoder-ring") if any(x["mode"] == m for x in runs)]
    # The headline baseline is sparse-cached where the run has it (older results: sparse).
    base = "sparse-cached" if any(x["mode"] == "sparse-cached" for x in runs) else "sparse"
    link_bound = {}
    for x in runs:
        inf = p50_of.get((x["mode"], x["context"], x["batch"], "inmem"))
        if x["link"] == "pcie5" and x.get("link_gbps") and inf:
            link_ms = (x["urgent_bytes_per_step"] + x["prefetch_bytes_per_step"]) / (x["link_gbps"] * 1e6)
            link_bound[(x["mode"], x["context"], x["batch"])] = inf / max(inf, link_ms)
    rows = []
    for ctx, b in sorted({(x["context"], x["batch"]) for x in runs if x["mode"] == "sparse"}):
        cells = []
        for m in duals:
            for link in slow:
                v, sp = tput.get((m, ctx, b, link)), tput.get((base, ctx, b, link))
                cells.append(f"{v / sp:.2f}×" if v and sp else "–")
            v, inf = tput.get((m, ctx, b, "pcie5")), tput.get((m, ctx, b, "inmem"))
            cells.append(f"{v / inf:.0%}" if v and inf else "–")
            # What the link allows at all: the step can be no shorter than the infinite-link step
            # nor than the time the link needs for the bytes the mode moves per step.
            bound = link_bound.get((m, ctx, b))
            cells.append(f"{bound:.0%}" if bound else "–")
        if paired(cells):
            rows.append(f"| {ctx} | {b} | " + " | ".join(cells) + " |")
    if rows and duals:
        heads = [f"{m} / {base} ({link})" for m in duals for link in slow + ["pcie5 vs inmem", "bound"]]
        heads = [h.replace(f"/ {base} (pcie5 vs inmem)", "pcie5 / inmem")
                  .replace(f"/ {base} (bound)", "pcie5 / inmem at most") for h in heads]
        lines += ["", f"Throughput over {base} (target for dualdecoder: ≥ 1.5× on pcie5), and each dualdecoder's "
                  "pcie5 throughput over its infinite-link throughput (target ≥ 90%) beside the most the link "
                  "allows (infinite-link p50 over the larger of it and the mode's bytes per step at the link's "
                  "bandwidth: where that is below 100%, the link needs longer than the compute for the bytes, so no prefetch "
                  "can reach 100%):", "",
                  "| context | batch | " + " | ".join(heads) + " |",
                  "|---:|---:|" + "---:|" * len(heads)] + rows
    # Real pool transports: dualdecoder over plain sparse and over sparse-cached on each.
    pool_links = [link for link in slow if link != "pcie5"]
    turns = {(x["mode"], x["context"], x["batch"], x["link"]): x.get("round_tokens_per_s") or [] for x in runs}

    def spread(a, z):  # a's throughput over z's, turn by turn: "(lo–hi)", or "" without turns
        q = [u / w for u, w in zip(turns.get(a, []), turns.get(z, [])) if w]
        return f" ({min(q):.2f}–{max(q):.2f})" if len(q) > 1 else ""
    prow = []
    # A pool store runs one dualdecoder: the model's default head (or the first one asked for).
    pool_dual = {lk: next((x["mode"] for x in runs if x["link"] == lk and x["mode"].startswith("dualdecoder")),
                          "dualdecoder") for lk in pool_links}
    for ctx, b in sorted({(x["context"], x["batch"]) for x in runs if x["link"] in pool_links}):
        cells = []
        for link in pool_links:
            dm = pool_dual[link]
            v = tput.get((dm, ctx, b, link))
            for bm in ("sparse", "sparse-cached"):
                sp = tput.get((bm, ctx, b, link))
                cells.append(f"{v / sp:.2f}×" + spread((dm, ctx, b, link), (bm, ctx, b, link))
                             if v and sp else "–")
        if paired(cells):
            prow.append(f"| {ctx} | {b} | " + " | ".join(cells) + " |")
    if prow:
        heads = [f"{link}: / {bm}" for link in pool_links for bm in ("sparse", "sparse-cached")]
        used = sorted(set(pool_dual.values()))
        lines += ["", f"KV in a real dd-kv-pool: {' / '.join(f'`{m}`' for m in used)}'s throughput over sparse and "
                  "over sparse-cached on the same transport (target over sparse on ucx://: ≥ 1.3×; `-inline`: gathers "
                  "on the compute thread, `-xN`: N transfer lanes, else 1):", "",
                  "| context | batch | " + " | ".join(heads) + " |", "|---:|---:|" + "---:|" * len(heads)] + prow
    # Each mode at its own largest batch (what a device holds at once): throughput at capacity.
    at_max = {(x["mode"], x["context"], x["link"]): x for x in runs if x.get("at_max_batch")}
    mrows = []
    for ctx, link in sorted({(c, lk) for (m, c, lk) in at_max if m == "dualdecoder"}):
        d = at_max[("dualdecoder", ctx, link)]
        cells = []
        for bm in ("sparse", "sparse-cached"):
            x = at_max.get((bm, ctx, link))
            cells.append(f"{x['tokens_per_s']:.1f} (b{x['batch']})" if x else "–")
        cells.append(f"{d['tokens_per_s']:.1f} (b{d['batch']})")
        for bm in ("sparse", "sparse-cached"):
            x = at_max.get((bm, ctx, link))
            cells.append(f"{d['tokens_per_s'] / x['tokens_per_s']:.2f}×" if x else "–")
        mrows.append(f"| {ctx} | {link} | " + " | ".join(cells) + " |")
    if mrows:
        lines += ["", "Each mode at its own largest batch under the device-memory budget (batch 'max', at most "
                  "--max_batch_cap): tok/s (batch) and dualdecoder over each (target over sparse: ≥ 0.85× on the "
                  "infinite link, ≥ 1.0× on the calibrated one):", "",
                  "| context | link | sparse | sparse-cached | dualdecoder | dualdecoder / sparse | "
                  "dualdecoder / sparse-cached |", "|---:|---|---:|---:|---:|---:|---:|"] + mrows
    # The speculative row's cost: a dual-token step's p50 over a sparse step's, infinite link.
    cost = []
    for (mode, ctx, b, link), v in sorted(p50_of.items()):
        sp = p50_of.get(("sparse", ctx, b, link))
        if mode == duals[0] and link == "inmem" and sp:
            cells = [f"{p50_of[(m, ctx, b, link)] / sp:.2f}×" if (m, ctx, b, link) in p50_of else "–" for m in duals]
            cost.append(f"| {ctx} | {b} | " + " | ".join(cells) + " |")
    if duals and cost:
        lines += ["", "Dual-token step time over a sparse step (p50, infinite link; target ≤ 1.2×):", "",
                  "| context | batch | " + " | ".join(duals) + " |", "|---:|---:|" + "---:|" * len(duals)] + cost
    lines += ["", "`dualdecoder` runs with `--spec_head context` (the speculative row scores only the "
              "sequence's own tokens), `dualdecoder-fullhead` with `--spec_head full`; the default `--spec_head auto` "
              "is the context head on Gemma 3 270M and the full head on SmolLM2 "
              "(docs/decisions/0009-speculative-row-cost.md)."]
    lines.append("")
    def draw(plt):
        ctxs = sorted({x["context"] for x in runs})
        fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
        for ax, ctx in zip(axes[0], ctxs):
            for mode in ("full", "sparse", "sparse-cached", "dualdecoder", "dualdecoder-fullhead", "dualdecoder-ring"):
                for link in ("inmem", "pcie5"):
                    pts = sorted((x["batch"], x["tokens_per_s"]) for x in runs
                                 if x["mode"] == mode and x["link"] == link and x["context"] == ctx)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{mode} / {link}")
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"context {ctx}")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Decode modes under {budget_mib:.0f} MiB device memory (CPU)")
        return fig

    lines += save_plot(doc, out_dir, "decode modes", draw)
    return "\n".join(lines) + "\n"


def summary_pool(doc, out_dir):
    r = doc["results"]
    runs = r["runs"]
    rnd = lambda x: x.get("round", 0)  # files before rounds have one
    n_rounds = len({rnd(x) for x in runs})
    base = {(rnd(x), x["blocks_per_gather"], x["concurrency"]): x["gbps"] for x in runs if x["transport"] == "memcpy"}
    cells = {}  # (transport, blocks, gatherers) -> its rows, one per round, in the order first measured
    for x in runs:
        cells.setdefault((x["transport"], x["blocks_per_gather"], x["concurrency"]), []).append(x)
    med = lambda xs: statistics.median(xs) if xs else None
    lines = [f"# KV-pool gathers ({doc['preset']})", "",
             f"{doc['machine']['cpu']} ({doc['machine']['cores']} cores), git {doc['git_sha'][:12]}, {doc['date']}. "
             f"Blocks of {r['block_bytes'] // 1024} KiB (one [K|V] chunk of Gemma 3 270M), drawn at random from "
             f"{r['chunks_per_gatherer']} per gatherer; memcpy is the same gather pattern in plain memory, same run.", "",
             "ucx-tcp / ucx-sm use active messages (the default, tenant-bounded); ucx-*-busy the same against a "
             "pool whose progress thread busy-polls (--ucx_busy_poll); ucx-*-rma one-sided gets (a pool run with "
             "--ucx_rma). 'vs tag_bw' is against ucx_perftest tag_bw at the gather's size over the same UCX_TLS, same "
             "run (a window of messages in flight: UCX's streaming figure); 'vs ping-pong' against ucx_perftest "
             "tag_lat (one message at a time each way, the size over the one-way latency: UCX's figure for one "
             "request at a time, as each gatherer's gathers go); yardsticks, not ceilings (the gathers' request is "
             "small, perftest's messages go both ways); measured in every round beside the rows, each row's ratio "
             "the median of its rounds' (min–max in brackets; with one round, to the median of 3 runs), all listed "
             "below. "
             "`cma` is the same gathers as one process_vm_readv each from another process: "
             "the kernel copy UCX's shared-memory zero-copy path uses, so the ceiling of any cma-based path. "
             "CPU columns: cores busy during the measurement, in the gathering process and in the pool.", ""]
    if n_rounds > 1:
        lines += [f"Every row was measured in {n_rounds} rounds, the transports in turn (reversed every other round); "
                  "the table gives medians over the rounds, and 'vs memcpy' the median of each round's ratio to that "
                  "round's memcpy (min–max in brackets): this shared host's speed swings up to 2x between minutes, so "
                  "rows measured minutes apart do not compare.", ""]
    lines += ["| transport | blocks/gather | gatherers | GB/s | vs memcpy | vs tag_bw | vs ping-pong | p50 ms | p99 ms | "
              "gatherer CPU | pool CPU |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    # ucx_perftest per (test, tls, blocks, round): files since 3c8f45a (2026-12-04) measure it in every round
    # (a yardstick taken seconds from the rows it judges); older ones once, at the end (round -1).
    yard_key = lambda c: (c.get("tool", "ucx_perftest tag_bw").split()[-1], "tcp" if c["ucx_tls"] == "tcp" else "sm",
                          c["blocks_per_gather"])
    yard_rounds = {}
    for c in r.get("ucx_ceiling", []):
        if c["gbps"] > 0:
            yard_rounds[(*yard_key(c), c.get("round", -1))] = c["gbps"]
    per_round = any(k[3] >= 0 for k in yard_rounds)

    def vs_yard(t, xs, test, blocks):
        """A row's ratio to the yardstick: per round (median, min–max), else to the one figure."""
        if not t.startswith("ucx"):
            return "–"
        tls = "tcp" if t.startswith("ucx-tcp") else "sm"
        if per_round:
            rs = [x["gbps"] / yard_rounds[(test, tls, blocks, rnd(x))] for x in xs
                  if yard_rounds.get((test, tls, blocks, rnd(x)))]
            if not rs:
                return "–"
            return f"{med(rs):.0%}" + (f" ({min(rs):.0%}–{max(rs):.0%})" if len(rs) > 1 else "")
        y = yard_rounds.get((test, tls, blocks, -1))
        return f"{med([x['gbps'] for x in xs]) / y:.0%}" if y else "–"
    medians = {}
    for (t, blocks, conc), xs in cells.items():
        gbps = med([x["gbps"] for x in xs])
        medians[(t, blocks, conc)] = gbps
        ratios = [x["gbps"] / base[(rnd(x), blocks, conc)] for x in xs if base.get((rnd(x), blocks, conc))]
        ratio = "–"
        if ratios:
            ratio = f"{med(ratios):.0%}" + (f" ({min(ratios):.0%}–{max(ratios):.0%})" if len(ratios) > 1 else "")
        vs = [vs_yard(t, xs, test, blocks) for test in ("tag_bw", "tag_lat")]
        cpu = []
        for k in ("gatherer_cpu_cores", "pool_cpu_cores"):
            v = med([x[k] for x in xs if x.get(k) is not None])
            cpu.append(f"{v:.2f}" if v is not None else "–")
        lines.append(f"| {t} | {blocks} | {conc} | {gbps:.2f} | {ratio} | {vs[0]} | {vs[1]} | "
                     f"{med([x['latency_ms_p50'] for x in xs]):.3f} | {med([x['latency_ms_p99'] for x in xs]):.3f} | "
                     f"{cpu[0]} | {cpu[1]} |")
    if yard_rounds:
        figures = {}  # (test, tls, blocks) -> every run's GB/s, in order
        for c in r.get("ucx_ceiling", []):
            figures.setdefault(yard_key(c), []).extend(c.get("gbps_runs") or [c["gbps"]])
        for test in ("tag_bw", "tag_lat"):
            got = sorted((k, v) for k, v in figures.items() if k[0] == test)
            if got:
                lines += ["", f"ucx_perftest {test} (GB/s, median; every run in order"
                          + (", one per round" if per_round and n_rounds > 1 else "") + "): " + ", ".join(
                              f"{tls} {blocks * r['block_bytes'] // 1024} KiB {med(v):.2f} "
                              f"({', '.join(f'{g:.2f}' for g in v)})" for (_, tls, blocks), v in got)]
    lines.append("")
    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for t in dict.fromkeys(k[0] for k in cells):
            pts = sorted((b, g) for (tt, b, c), g in medians.items() if tt == t and c == 1)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=t)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("blocks per gather (1 gatherer)")
        ax.set_ylabel("GB/s" + (f" (median of {n_rounds} rounds)" if n_rounds > 1 else ""))
        ax.legend()
        return fig

    lines += save_plot(doc, out_dir, "pool gathers", draw)
    return "\n".join(lines) + "\n"


def summary_serve(doc, out_dir):
    r = doc["results"]
    c = r["config"]
    lines = [f"# Serving benchmark ({doc['preset']})", "",
             f"`ddctl serve` (router + worker + in-process pool) on {doc['machine']['cpu']} "
             f"({doc['machine']['cores']} cores), git {doc['git_sha'][:12]}, {doc['date']}. Open-loop Poisson "
             f"arrivals, {c['requests']} requests per rate, prompts of {r['memory']['full']['prompt_tokens']} tokens, "
             f"{c['max_new_tokens']} new tokens each, device-memory budget {c['device_memory']} for both modes, "
             f"sparse budget {c['sparse_budget_tokens']} tokens.", "",
             "| mode | KV per request | requests that fit the budget (projected) |", "|---|---:|---:|"]
    for mode, m in r["memory"].items():
        free = m["budget_bytes"] - m["weights_bytes"] - m["workspace_bytes"] - m["prefill_extra_bytes"]
        fit = max(0, free // max(1, m["kv_bytes_per_request"]))
        lines.append(f"| {mode} | {m['kv_bytes_per_request'] / 2**20:.1f} MiB | {fit} |")
    lines += ["", "| mode | rate (req/s) | throughput (tok/s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | errors |",
              "|---|---:|---:|---:|---:|---:|"]
    for mode, rows in r["modes"].items():
        for x in rows:
            lines.append(f"| {mode} | {x['rate_rps']:g} | {x['throughput_tok_s']:.2f} | {x['ttft_p50_s']:.2f} / "
                         f"{x['ttft_p99_s']:.2f} | {x['tpot_p50_s'] * 1e3:.0f} / {x['tpot_p99_s'] * 1e3:.0f} | "
                         f"{x['errors']} |")
    modes = list(r["modes"])
    if len(modes) == 2:
        lines += ["", f"Ratios {modes[1]} / {modes[0]} at equal rate (same run):", ""]
        for a, b in zip(r["modes"][modes[0]], r["modes"][modes[1]]):
            def ratio(k):
                return b[k] / a[k] if a[k] else float("nan")
            lines.append(f"- {a['rate_rps']:g} req/s: throughput {ratio('throughput_tok_s'):.2f}x, "
                         f"TTFT p50 {ratio('ttft_p50_s'):.2f}x, TPOT p50 {ratio('tpot_p50_s'):.2f}x")

    def draw(plt):
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
        for k, (mode, rows) in enumerate(r["modes"].items()):
            x, col = [q["rate_rps"] for q in rows], f"C{k}"
            ax[0].plot(x, [q["throughput_tok_s"] for q in rows], "o-", color=col, label=mode)
            ax[1].plot(x, [q["ttft_p50_s"] for q in rows], "o-", color=col, label=f"{mode} p50")
            ax[1].plot(x, [q["ttft_p99_s"] for q in rows], "x--", color=col, label=f"{mode} p99")
            ax[2].plot(x, [q["tpot_p50_s"] * 1e3 for q in rows], "o-", color=col, label=f"{mode} p50")
            ax[2].plot(x, [q["tpot_p99_s"] * 1e3 for q in rows], "x--", color=col, label=f"{mode} p99")
        for a_, t in zip(ax, ("throughput (tok/s)", "TTFT (s)", "TPOT (ms)")):
            a_.set_xlabel("arrival rate (req/s)")
            a_.set_title(t)
            a_.legend(fontsize=7)
        return fig

    lines += [""] + save_plot(doc, out_dir, "throughput, TTFT and TPOT vs arrival rate", draw)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name")
    ap.add_argument("--preset")
    ap.add_argument("--raw")
    ap.add_argument("--out-dir")
    ap.add_argument("--command", default="", help="the command line that produced the results")
    ap.add_argument("--model", default="", help="the model file the benchmark ran")
    ap.add_argument("--summarize", metavar="RESULTS_JSON",
                    help="only rewrite the summary (and plot) of an existing results file from what it records "
                         "(its commit, command and figures stay as they are)")
    a = ap.parse_args()
    if a.summarize:
        try:
            with open(a.summarize) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"wrap_results: cannot read {a.summarize} as JSON: {e}")
        if not isinstance(doc, dict) or "benchmark" not in doc or "results" not in doc:
            sys.exit(f"wrap_results: {a.summarize} is not a results file (no 'benchmark' or 'results')")
        a.name, a.out_dir = doc["benchmark"], os.path.dirname(os.path.abspath(a.summarize))
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("name", "preset", "raw", "out_dir") if not getattr(a, k)]
        if missing:
            ap.error("needs " + ", ".join(missing) + " (or --summarize RESULTS_JSON)")
        with open(a.raw) as f:
            results = json.load(f)
        doc = {"benchmark": a.name, "preset": a.preset, "command": a.command, "model_file": a.model,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "git_sha": git_sha(), "machine": machine(), "results": results}
        out = os.path.join(a.out_dir, a.name + ".json")
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
        os.replace(tmp, out)
    md = os.path.join(a.out_dir, a.name + ".md")
    text = summary(doc, a.name, a.out_dir)  # before opening the summary: a failure leaves the old one
    with open(md, "w") as f:
        f.write(text)
    print(f"bench: wrote {md}" if a.summarize else f"bench: wrote {out} and {md}")


def summary(doc, name, out_dir):
    if name.startswith("decode-modes"):
        return summary_modes(doc, out_dir)
    if name.startswith("serve"):
        return summary_serve(doc, out_dir)
    if name.startswith("pool"):
        return summary_pool(doc, out_dir)
    if name.startswith("model"):
        return summary_model(doc)
    sys.exit(f"wrap_results: no summary for benchmark '{name}' (decode-modes*, serve*, pool*, model*)")


if __name__ == "__main__":
    main()
