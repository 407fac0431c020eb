"""Wraps a benchmark's raw JSON with config, machine and git sha, and writes a summary.

Usage: wrap_results.py --name model-cpu --preset quick --raw RAW.json --out-dir bench/results
"""
import argparse
import datetime
import json
import os
import platform
import subprocess


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
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    with open(a.raw) as f:
        results = json.load(f)
    doc = {"benchmark": a.name, "preset": a.preset, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": git_sha(), "machine": machine(), "results": results}
    out = os.path.join(a.out_dir, a.name + ".json")
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, out)
    md = os.path.join(a.out_dir, a.name + ".md")
    with open(md, "w") as f:
        f.write(summary_model(doc))
    print(f"bench: wrote {out} and {md}")


if __name__ == "__main__":
    main()
