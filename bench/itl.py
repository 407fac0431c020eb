#!/usr/bin/env python3
"""Inter-token latency under concurrent prompts, per prefill budget: `ddctl serve` with each
--decode_prefill_tokens (prompt tokens read per scheduler iteration while requests decode)
driven through its OpenAI endpoint by the stock `openai` client. At 1, 4 and 8 concurrent
streams, each stream sends requests one after another, each with a distinct ~2000-token prompt
and streaming 64 tokens; recorded are TTFT, the gaps between streamed tokens (ITL), request
throughput and output tokens/s. Writes bench/results/serve-itl.json and serve-itl.md.

    python3 bench/itl.py --bin build/bin [--budgets 0,256,128,64] [--streams 1,4,8] [--requests 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import long_text  # noqa: E402
from wrap_results import git_sha, machine  # noqa: E402


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_server(bin_dir, model, budget, threads):
    cmd = [os.path.join(bin_dir, "ddctl"), "serve", f"--model={model}", "--http_listen=127.0.0.1:0",
           "--max_batch=8", f"--decode_prefill_tokens={budget}", "--prefix_block=0"]
    if threads:
        cmd.append(f"--threads={threads}")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        p.kill()
        raise RuntimeError(f"ddctl serve did not start: {line!r}")
    words = line.split()
    return p, words[words.index("http") + 1]


def stream_once(client, prompt, max_tokens, temperature):
    t0 = time.monotonic()
    times, usage = [], None
    for chunk in client.completions.create(model="", prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.monotonic()
    return {"ttft": times[0] - t0 if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": usage.completion_tokens if usage else len(times), "latency": end - t0}


def run_load(http, streams, requests, prompts, max_tokens, temperature):
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=600)
    results, errors, lock = [], [], threading.Lock()

    def worker(s):
        for r in range(requests):
            try:
                out = stream_once(client, prompts[(s * requests + r) % len(prompts)], max_tokens, temperature)
                with lock:
                    results.append(out)
            except Exception as e:  # recorded, not raised: an error is a result
                with lock:
                    errors.append(str(e)[:200])

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"streams": streams, "requests": len(results), "errors": errors, "wall_s": wall,
            "request_throughput": len(results) / wall, "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p90": pct(ttfts, 0.9), "itl_p50": pct(gaps, 0.5),
            "itl_p90": pct(gaps, 0.9), "itl_p99": pct(gaps, 0.99), "itl_max": max(gaps) if gaps else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", default="gemma")
    ap.add_argument("--budgets", default="0,256,128,64")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream, one after another")
    ap.add_argument("--prompt-chars", type=int, default=9000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--name", default="serve-itl")
    ap.add_argument("--command", default="python3 bench/itl.py --bin build/bin")
    a = ap.parse_args()
    text = long_text(a.prompt_chars * 3)
    streams = [int(s) for s in a.streams.split(",")]
    n_prompts = max(streams) * a.requests
    # Distinct prompts: each starts with its own number and at its own place in the text.
    prompts = [f"Document {i}.\n" + text[(i * 997) % (len(text) - a.prompt_chars):][:a.prompt_chars]
               for i in range(n_prompts)]
    doc = {"name": a.name, "command": a.command, "git_sha": git_sha(), "machine": machine(), "model": a.model,
           "prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens, "temperature": a.temperature,
           "requests_per_stream": a.requests, "runs": []}
    for budget in [int(b) for b in a.budgets.split(",")]:
        proc, http = start_server(a.bin, a.model, budget, a.threads)
        try:
            run_load(http, 1, 1, prompts[-1:], 4, a.temperature)  # warm-up
            for s in streams:
                r = run_load(http, s, a.requests, prompts, a.max_tokens, a.temperature)
                r["decode_prefill_tokens"] = budget
                doc["runs"].append(r)
                print(f"itl: budget {budget or 'step_tokens'} streams {s}: ITL p50 {r['itl_p50'] * 1e3:.0f} ms p99 "
                      f"{r['itl_p99'] * 1e3:.0f} ms, TTFT p50 {r['ttft_p50']:.2f} s, {r['request_throughput']:.3f} req/s, "
                      f"{len(r['errors'])} errors", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, f"{a.name}.json"), "w") as f:
        json.dump(doc, f, indent=2)
    ms = lambda x: f"{x * 1e3:.0f}" if x is not None else "–"  # noqa: E731
    lines = [f"# Inter-token latency under concurrent prompts, per prefill budget ({a.model})", "",
             f"`{a.command}` at {doc['git_sha']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores). "
             f"`ddctl serve` through its OpenAI endpoint and the `openai` client; each stream sends {a.requests} "
             f"requests one after another, each a distinct {a.prompt_chars}-character prompt streaming "
             f"{a.max_tokens} tokens (temperature {a.temperature}). Budget: `--decode_prefill_tokens`, prompt "
             "tokens read per iteration while requests decode (0: `--step_tokens` 512 less the decode rows).", "",
             "| budget | streams | ITL p50 ms | ITL p90 ms | ITL p99 ms | TTFT p50 s | TTFT p90 s | req/s | output tok/s | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        lines.append(f"| {r['decode_prefill_tokens']} | {r['streams']} | {ms(r['itl_p50'])} | {ms(r['itl_p90'])} | "
                     f"{ms(r['itl_p99'])} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['request_throughput']:.3f} | "
                     f"{r['output_tokens_per_s']:.1f} | {len(r['errors'])} |")
    with open(os.path.join(a.out_dir, f"{a.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
