#!/usr/bin/env python3
"""Time to first token of a repeated (cached) prompt on `ddctl serve` (docs/architecture.md,
"Prefix reuse"): one ~2200-token prompt is sent once, then again by 1 stream (one request after
another) and by S concurrent streams. Variants (`LABEL=BINDIR:BLOCK`, a build and a --prefix_block)
run in alternating order round by round on the same machine, so their ratios compare like with
like. TTFT is the server's own (Usage.ttft_seconds: arrival at the router to the first token).
Writes bench/results/NAME.{json,md}."""
import argparse
import concurrent.futures as cf
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import wrap_results  # noqa: E402  (machine(), git_sha())
PROMPT = ("The committee met on Tuesday to review the quarterly figures, and the chair asked each member "
          "to report. ") * 110


def parse_variant(text):
    label, _, rest = text.partition("=")
    bindir, _, block = rest.rpartition(":")
    if not label or not bindir or not block.isdigit():
        raise argparse.ArgumentTypeError(f"variant '{text}': expected LABEL=BINDIR:BLOCK (e.g. b64=build/bin:64)")
    if not (Path(bindir) / "ddctl").is_file():
        raise argparse.ArgumentTypeError(f"variant '{text}': no ddctl in {bindir}")
    return {"label": label, "bin": str(Path(bindir) / "ddctl"), "block": int(block)}


def generate(ddctl, addr):
    r = subprocess.run([ddctl, "generate", "--server", addr, "--prompt", PROMPT, "--max_new_tokens", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"ddctl generate failed: {r.stderr.strip()}")
    usage = json.loads(r.stdout.strip().splitlines()[-1])["usage"]
    return usage["ttft_seconds"], int(usage.get("prefix_reused_tokens", 0))


def one_round(v, a):
    p = subprocess.Popen([v["bin"], "serve", "--listen", "127.0.0.1:0", "--threads", str(a.threads),
                          f"--prefix_block={v['block']}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"{v['label']}: ddctl serve did not start: {line!r}")
        addr = line.split("listening on ")[1].split()[0]
        generate(v["bin"], addr)  # the first request commits the prompt
        one = [generate(v["bin"], addr) for _ in range(a.sequential)]
        many = []
        for _ in range(a.bursts):
            with cf.ThreadPoolExecutor(a.streams) as ex:
                many += list(ex.map(lambda _: generate(v["bin"], addr), range(a.streams)))
        return one, many
    finally:
        p.terminate()
        p.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("variants", nargs="+", type=parse_variant, help="LABEL=BINDIR:BLOCK, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential", type=int, default=8, help="cached requests one after another, per round")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--bursts", type=int, default=3, help="rounds of --streams concurrent cached requests, per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="cached-ttft")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    got = {v["label"]: {"one": [], "many": [], "reused": set()} for v in a.variants}
    for r in range(a.rounds):
        order = a.variants if r % 2 == 0 else list(reversed(a.variants))
        for v in order:
            one, many = one_round(v, a)
            g = got[v["label"]]
            g["one"] += [t for t, _ in one]
            g["many"] += [t for t, _ in many]
            g["reused"] |= {n for _, n in one + many}
            print(f"cached-ttft: round {r + 1}/{a.rounds} {v['label']}: 1 stream median "
                  f"{statistics.median(t for t, _ in one) * 1e3:.0f} ms, {a.streams} streams median "
                  f"{statistics.median(t for t, _ in many) * 1e3:.0f} ms", file=sys.stderr)
    base = got[a.variants[0]["label"]]
    rows = []
    for v in a.variants:
        g = got[v["label"]]
        p90 = sorted(g["many"])[int(0.9 * (len(g["many"]) - 1))]
        rows.append({"label": v["label"], "bin": v["bin"], "prefix_block": v["block"],
                     "prefix_reused_tokens": sorted(g["reused"]),
                     "ttft_1_stream_median_ms": statistics.median(g["one"]) * 1e3,
                     f"ttft_{a.streams}_streams_median_ms": statistics.median(g["many"]) * 1e3,
                     f"ttft_{a.streams}_streams_p90_ms": p90 * 1e3,
                     "ratio_1_stream": statistics.median(g["one"]) / statistics.median(base["one"]),
                     f"ratio_{a.streams}_streams": statistics.median(g["many"]) / statistics.median(base["many"]),
                     "samples": {"one": g["one"], "many": g["many"]}})
    out = {"command": " ".join(["python3", "bench/cached_ttft.py", *sys.argv[1:]]), "git_sha": wrap_results.git_sha(),
           "date": datetime.date.today().isoformat(), "machine": wrap_results.machine(),
           "prompt_chars": len(PROMPT), "rounds": a.rounds, "streams": a.streams, "rows": rows}
    d = Path(a.out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    md = [f"# {a.name}: TTFT of a repeated prompt on `ddctl serve` (full mode)", "",
          f"`{out['command']}` at {out['git_sha']}, {a.threads} threads, {a.rounds} rounds (variants alternating), "
          f"{a.sequential} sequential and {a.bursts} × {a.streams} concurrent cached requests per round; TTFT is the "
          "server's (arrival at the router to the first token).", "",
          f"| variant | --prefix_block | restored tokens | 1 stream median | {a.streams} streams median (p90) | "
          f"ratio to {a.variants[0]['label']}: 1 / {a.streams} streams |", "|---|---|---|---|---|---|"]
    for row in rows:
        md.append(f"| {row['label']} | {row['prefix_block']} | {', '.join(map(str, row['prefix_reused_tokens']))} | "
                  f"{row['ttft_1_stream_median_ms']:.0f} ms | {row[f'ttft_{a.streams}_streams_median_ms']:.0f} ms "
                  f"({row[f'ttft_{a.streams}_streams_p90_ms']:.0f}) | {row['ratio_1_stream']:.2f} / "
                  f"{row[f'ratio_{a.streams}_streams']:.2f} |")
    (d / f"{a.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
