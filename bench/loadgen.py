#!/usr/bin/env python3
"""Serving under a standard load generator: guidellm (the vLLM project's) drives `ddctl serve`
(full and dualdecoder) and llama.cpp's llama-server on the same GGUF, one server at a time,
through their OpenAI chat endpoints, at 1, 4 and 8 concurrent streams of distinct ~2000-token
prompts and 64 output tokens, greedy and sampled (no temperature sent: each server's default).
Records request throughput, output tokens/s, TTFT and ITL p50/p90/p99 and errors, with
guidellm's own JSON beside them. Writes bench/results/serve-loadgen.json and .md; the raw
guidellm reports go to bench/results/serve-loadgen-raw/ (gzip). guidellm's ITL is a request's mean
gap between tokens, its percentiles over requests.

guidellm comes from PyPI into a virtual environment outside the repository (a large stack,
torch included: not part of the project's dependencies), llama-server from
`bench/build-llamacpp --server`. guidellm's synthetic prompts need a Hugging Face tokenizer, which
a machine without the Hub cannot fetch, so the prompts are a JSON-lines file of natural text.

    bench/run serve-loadgen          # installs guidellm, builds llama-server, runs, writes results
    python3 bench/loadgen.py --bin build/bin --guidellm VENV/bin/guidellm --llama-server DIR/llama-server
"""
import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eval"))
import models  # noqa: E402
from serve import long_text  # noqa: E402
from wrap_results import git_sha, machine  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, seconds=300):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health never answered 200")


def start(server, a, model_path, log):
    if server.startswith("ddctl"):
        mode = server.split("-", 1)[1]
        cmd = [os.path.join(a.bin, "ddctl"), "serve", f"--model={model_path}", f"--mode={mode}",
               "--http_listen=127.0.0.1:0", "--max_batch=8"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        words = p.stdout.readline().split()
        if "http" not in words:
            p.kill()
            raise RuntimeError(f"ddctl serve did not start: {' '.join(words)}")
        url = "http://" + words[words.index("http") + 1]
    else:
        port = free_port()
        # 8 slots of 4096 tokens each: room for a 2000-token prompt and its output per stream.
        cmd = [a.llama_server, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-np", "8",
               "-c", "32768", "-t", str(os.cpu_count())]
        p = subprocess.Popen(cmd, stdout=log, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
    wait_healthy(url, p)
    return p, url


def guidellm(a, url, streams, requests, data, greedy, out):
    backend = {"kind": "openai_http", "target": url, "max_tokens": a.max_tokens}
    if greedy:
        backend["extras"] = {"body": {"temperature": 0}}
    cmd = [a.guidellm, "run", "--backend", json.dumps(backend), "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={requests}", "--data", f"kind=json_file,path={data}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise RuntimeError(f"guidellm failed ({r.returncode}): {r.stderr[-2000:]}")
    with open(out) as f:
        b = json.load(f)["benchmarks"][0]
    # The raw report holds every prompt: kept compressed.
    with open(out, "rb") as f, gzip.open(out + ".gz", "wb") as z:
        shutil.copyfileobj(f, z)
    os.remove(out)
    m, st = b["metrics"], b["scheduler_state"]
    ok = b["requests"]["successful"]
    wall = st["end_requests_time"] - st["start_requests_time"]
    pct = lambda name, p: m[name]["successful"]["percentiles"][p]  # noqa: E731
    return {"streams": streams, "greedy": greedy, "successful": st["successful_requests"],
            "errored": st["errored_requests"], "cancelled": st["cancelled_requests"], "wall_s": wall,
            "request_throughput": st["successful_requests"] / wall,
            "output_tokens_per_s": sum(x["output_tokens"] or 0 for x in ok) / wall,
            "usage_from_server": all(x["output_tokens"] is not None and x["prompt_tokens"] is not None for x in ok),
            "ttft_ms": {p: pct("time_to_first_token_ms", p) for p in ("p50", "p90", "p99")},
            "itl_ms": {p: pct("inter_token_latency_ms", p) for p in ("p50", "p90", "p99")}}


def cached_run(a, url, server, streams, text, tmp, raw_dir):
    """One prompt, sent once first (so the server may cache it), then `requests-per-stream` times by
    each of `streams` streams at once: TTFT of a repeated prompt."""
    prompt = f"Document {server} cached.\n" + text[:a.prompt_chars]
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    n = streams * a.requests_per_stream
    data = os.path.join(tmp, f"cached-{server}-{streams}.jsonl")
    with open(data, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return dict(guidellm(a, url, streams, n, data, True, os.path.join(raw_dir, f"{server}-cached-{streams}.json")),
                server=server)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--guidellm", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default="gemma")
    ap.add_argument("--servers", default="ddctl-full,ddctl-dualdecoder,llama-server")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-chars", type=int, default=9000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--command", default="bench/run serve-loadgen")
    ap.add_argument("--cached", action="store_true",
                    help="instead: one prompt repeated, sent once first, then by every stream (serve-loadgen-cached)")
    a = ap.parse_args()
    model_path = str(models.model_path(a.model))
    streams = [int(s) for s in a.streams.split(",")]
    text = long_text(a.prompt_chars * 3)
    raw_dir = os.path.join(a.out_dir, "serve-loadgen-raw")
    os.makedirs(raw_dir, exist_ok=True)
    doc = {"name": "serve-loadgen", "command": a.command, "git_sha": git_sha(), "machine": machine(),
           "model": os.path.basename(model_path), "guidellm": subprocess.run([a.guidellm, "--version"],
                                                                               capture_output=True, text=True).stdout.strip(),
           "prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for server in a.servers.split(","):
            log = open(os.path.join(tmp, f"{server}.log"), "w")
            proc, url = start(server, a, model_path, log)
            try:
                if a.cached:
                    for s in streams:
                        r = cached_run(a, url, server, s, text, tmp, raw_dir)
                        doc["runs"].append(r)
                        print(f"loadgen: {server} cached prompt, {s} streams: {r['successful']} ok, {r['errored']} "
                              f"errors, TTFT p50 {r['ttft_ms']['p50']:.0f} ms", file=sys.stderr)
                    continue
                for greedy in (True, False):
                    for s in streams:
                        n = s * a.requests_per_stream
                        # Distinct prompts per run: nothing a server cached from an earlier run helps.
                        data = os.path.join(tmp, f"prompts-{server}-{greedy}-{s}.jsonl")
                        with open(data, "w") as f:
                            for i in range(n):
                                off = (i * 997 + s * 131 + (0 if greedy else 53)) % (len(text) - a.prompt_chars)
                                f.write(json.dumps({"prompt": f"Document {server} {greedy} {s} {i}.\n" +
                                                    text[off:off + a.prompt_chars]}) + "\n")
                        out = os.path.join(raw_dir, f"{server}-{'greedy' if greedy else 'sampled'}-{s}.json")
                        r = guidellm(a, url, s, n, data, greedy, out)
                        r["server"] = server
                        doc["runs"].append(r)
                        print(f"loadgen: {server} {'greedy' if greedy else 'sampled'} {s} streams: "
                              f"{r['successful']} ok, {r['errored']} errors, ITL p50 {r['itl_ms']['p50']:.0f} ms "
                              f"p99 {r['itl_ms']['p99']:.0f} ms, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                              f"{r['request_throughput']:.3f} req/s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
    name = "serve-loadgen-cached" if a.cached else "serve-loadgen"
    doc["name"] = name
    with open(os.path.join(a.out_dir, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=2)
    lines = [f"# Serving under guidellm: ddctl serve against llama-server ({doc['model']})", "",
             f"`{a.command}` at {doc['git_sha']} on {doc['machine']['cpu']} ({doc['machine']['cores']} cores), "
             f"{doc['guidellm']}. Chat endpoint, concurrent streams, {a.requests_per_stream} requests per stream, "
             f"distinct {a.prompt_chars}-character prompts, {a.max_tokens} output tokens; sampled = no temperature "
             "sent (each server's default). Raw guidellm reports (gzip): serve-loadgen-raw/. guidellm's ITL is each request's mean gap between tokens; its percentiles are over requests.", "",
             "| server | sampling | streams | req/s | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(f"| {r['server']} | {'greedy' if r['greedy'] else 'sampled'} | {r['streams']} | "
                     f"{r['request_throughput']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {i['p50']:.0f} / {i['p90']:.0f} / {i['p99']:.0f} | "
                     f"{r['errored']} |")
    if a.cached:
        lines[0] = f"# A repeated prompt under guidellm: ddctl serve against llama-server ({doc['model']})"
        lines[2] += (" Cached: one prompt, sent once first (greedy, 1 token), then by every stream; the rows' "
                     "sampling is greedy.")
    with open(os.path.join(a.out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
