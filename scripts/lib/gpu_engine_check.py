#!/usr/bin/env python3
"""The engine on the CUDA device, end to end, on models a bare GPU machine has: the project's
tiny synthetic models (tests/reference/make_synthetic.py, carried in .gpu-bundle/models).

For each model, greedy `ddctl generate` over a prompt long enough that chunk selection matters
(budget 16 tokens of ~90 selectable chunks), in every mode on `cuda` and `full` on `cpu`:
  - sparse, sparse-cached and dualdecoder give the same tokens (real rows are bit-identical
    across them; the slow-link case is logits_hash_test's, which needs the real models);
  - full on cuda gives the cpu's tokens, or the first step where they part is reported (random
    weights make near-ties likelier than a trained model does);
  - the sparse modes' blocks, in the in-process store's arena (registered with the device),
    are all gathered by the device itself;
  - with --pool (a dd-kv-pool binary): sparse-cached and dualdecoder with the KV in a shm://
    pool, which the device gathers from the registered region itself
    (docs/decisions/0039-device-gathers-from-pool.md), give sparse@cuda's tokens;
  - and with the KV in a ucx:// pool (UCX over shared memory): the same tokens, every block
    landed through the registered staging by one device gather per buffer;
  - full and dualdecoder with --cuda_graphs (static segments as CUDA graphs) give the tokens of
    full and sparse without.
First, for each model and mode, `ddctl device-check` (the start-up check every serving binary runs:
docs/decisions/0044-device-check.md) records how far the device's logits are from the cpu's. The
generate runs then pass --allow_incorrect_device, so a failed start-up check does not hide the
token comparisons below.
Writes a JSON summary (tokens/s per mode, the checks) to --out; exit status 1 when a check fails.

    gpu_engine_check.py --ddctl BIN --models DIR --out FILE.json [--pool DD_KV_POOL]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile

MODES = ["full", "sparse", "sparse-cached", "dualdecoder"]
POOL_MODES = ["sparse-cached", "dualdecoder"]
GRAPH_MODES = ["full", "dualdecoder"]
F16_MODES = ["full", "sparse", "dualdecoder"]
TOKEN = "gpu-check-token-0123456789"


def generate(ddctl: str, model: str, prompt_file: str, device: str, mode: str, extra: list[str],
             env: dict | None = None) -> dict:
    cmd = [ddctl, "generate", "--model", model, "--prompt_file", prompt_file, "--raw_prompt", "--device", device,
           "--mode", mode, "--budget", "16", "--max_new_tokens", "48", "--temperature", "0", "--ignore_eos",
           "--json"] + extra + (["--allow_incorrect_device"] if device != "cpu" else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DD_KV_POOL_TOKEN=TOKEN, **(env or {})))
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout)


def device_check(ddctl: str, model: str, device: str, mode: str) -> dict:
    """`ddctl device-check` of `device` in `mode`: its JSON report without the rows (exit 1 is a
    failed check, reported; anything else raises)."""
    cmd = [ddctl, "device-check", "--model", model, "--device", device, "--mode", mode, "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode not in (0, 1) or not run.stdout.strip():
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    report = json.loads(run.stdout)
    report.pop("rows", None)
    return report


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddctl", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="the device checked against cpu (sim checks this script here)")
    ap.add_argument("--pool", help="a dd-kv-pool binary: also run the sparse modes with KV in a shm:// pool")
    args = ap.parse_args()
    words = "the river flows past the mill and the keeper counts each ship that passes the light".split()
    summary: dict = {"models": {}, "failures": []}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = f"{tmp}/prompt.txt"
        with open(prompt, "w") as f:
            f.write(" ".join(f"{words[i % len(words)]} {i}" for i in range(150)))
        pool = start_pool(args.pool, tmp, summary) if args.pool else None
        ucx_pool = start_pool(args.pool, tmp, summary, ucx=True) if args.pool else None
        try:
            check_models(args, prompt, summary, pool[1] if pool else None, ucx_pool[1] if ucx_pool else None)
        finally:
            for p in (pool, ucx_pool):
                if p:
                    stop_pool(p[0])
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    for line in summary["failures"]:
        print(f"gpu_engine_check: {line}", file=sys.stderr)
    print(json.dumps(summary["models"], indent=1, sort_keys=True), file=sys.stderr)
    return 1 if summary["failures"] else 0


def start_pool(exe: str, tmp: str, summary: dict, ucx: bool = False):
    """(process, address) of a dd-kv-pool with one tenant, or None (a failure noted). Without
    `ucx` only its shm:// path (--ucx=false); with it, UCX too (no tcp: the worker reaches it over
    shared memory). Its log goes to a file, and its first line must come within 30 s."""
    name = "ucx-pool" if ucx else "pool"
    cfg = f"{tmp}/{name}-tenants.json"
    with open(cfg, "w") as f:
        json.dump([{"name": "gpu-check", "token": TOKEN, "quota": "256MiB"}], f)
    os.chmod(cfg, 0o600)  # it holds the token: the pool refuses it readable by others
    log = open(f"{tmp}/{name}.log", "w")
    proc = subprocess.Popen([exe, f"--tenants={cfg}", f"--ucx={'true' if ucx else 'false'}"], stdout=subprocess.PIPE,
                            stderr=log, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""  # "dd-kv-pool: listening on HOST:PORT metrics HOST:PORT"
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        log.close()
        with open(f"{tmp}/{name}.log") as f:
            summary["failures"].append(f"dd-kv-pool ({name}) did not start (no listening line within 30 s): {line!r} "
                                       f"{f.read()[-1000:]}")
        return None
    return proc, line.split()[3]


def stop_pool(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def check_models(args: argparse.Namespace, prompt: str, summary: dict, pool: str | None, ucx_pool: str | None) -> None:
    for name in ["tiny-llama", "tiny-qwen2"]:
        model = f"{args.models}/{name}.gguf"
        runs = {}
        try:
            reports = {mode: device_check(args.ddctl, model, args.device, mode) for mode in MODES}
            summary.setdefault("device_check", {})[name] = reports
            for mode, r in reports.items():
                if not r["passed"]:
                    summary["failures"].append(f"{name}: start-up device check, {mode}: {r['reason']}")
            for mode in MODES:
                runs[f"{mode}@cuda"] = generate(args.ddctl, model, prompt, args.device, mode, [])
            # Static segments as CUDA graphs: the same kernels, so the same tokens (sim has none).
            graphs = ["--cuda_graphs"] if args.device == "cuda" else []
            for mode in GRAPH_MODES:
                runs[f"{mode}@cuda+graphs"] = generate(args.ddctl, model, prompt, args.device, mode, graphs)
            runs["full@cpu"] = generate(args.ddctl, model, prompt, "cpu", "full", [])
            # KV kept in f16 (docs/decisions/0049-kv-storage-type.md): the kernels that widen it.
            f16 = ["--kv_dtype", "f16"]
            for mode in F16_MODES:
                runs[f"{mode}@cuda/f16"] = generate(args.ddctl, model, prompt, args.device, mode, f16)
            runs["full@cpu/f16"] = generate(args.ddctl, model, prompt, "cpu", "full", f16)
            for mode in POOL_MODES if pool else []:
                runs[f"{mode}@cuda+shm"] = generate(args.ddctl, model, prompt, args.device, mode,
                                                    ["--kv_store", f"shm://{pool}"])
            for mode in POOL_MODES if ucx_pool else []:
                runs[f"{mode}@cuda+ucx"] = generate(args.ddctl, model, prompt, args.device, mode,
                                                    ["--kv_store", f"ucx://{ucx_pool}"], {"UCX_TLS": "sm,self"})
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            summary["failures"].append(f"{name}: {e}")
            continue
        tokens = {k: v["tokens"] for k, v in runs.items()}
        checks = {}
        d = first_difference(tokens["full@cuda"], tokens["full@cuda+graphs"])
        checks["full@cuda+graphs == full@cuda"] = d == -1
        if d != -1:
            summary["failures"].append(f"{name}: full@cuda+graphs leaves full@cuda at token {d}")
        for other in (["sparse-cached@cuda", "dualdecoder@cuda", "dualdecoder@cuda+graphs"] +
                      [f"{m}@cuda+shm" for m in POOL_MODES if pool] + [f"{m}@cuda+ucx" for m in POOL_MODES if ucx_pool]):
            d = first_difference(tokens["sparse@cuda"], tokens[other])
            checks[f"{other} == sparse@cuda"] = d == -1
            if d != -1:
                summary["failures"].append(f"{name}: {other} leaves sparse@cuda at token {d}")
        # The device gathers every block itself: from the in-process store's arena, registered
        # with it, and from the pool's region. From the ucx:// pool, every block through the
        # registered staging: one device gather per buffer, none copied block by block.
        gathered = [f"{m}@cuda" for m in MODES if m != "full"] + [f"{m}@cuda+shm" for m in POOL_MODES if pool]
        staged = [f"{m}@cuda+ucx" for m in POOL_MODES if ucx_pool]
        for run, field, how in ([(r, "device_gathered_chunks", "gathered by the device") for r in gathered] +
                                [(r, "staged_gathered_chunks", "staged and gathered by the device") for r in staged]):
            r = runs[run]
            ok = r.get("fetched_chunks", 0) > 0 and r.get(field) == r["fetched_chunks"]
            checks[f"{run} {how}"] = ok
            if not ok:
                summary["failures"].append(f"{name}: {run}: {r.get(field)} of {r.get('fetched_chunks')} chunks {how}")
        d = first_difference(tokens["sparse@cuda/f16"], tokens["dualdecoder@cuda/f16"])
        checks["dualdecoder@cuda/f16 == sparse@cuda/f16"] = d == -1
        if d != -1:
            summary["failures"].append(f"{name}: dualdecoder@cuda/f16 leaves sparse@cuda/f16 at token {d}")
        for dev in ("cuda", "cpu"):
            r = runs[f"full@{dev}/f16"]
            ok = r.get("kv_dtype") == "f16"
            checks[f"full@{dev}/f16 keeps f16 KV"] = ok
            if not ok:
                summary["failures"].append(f"{name}: full@{dev}/f16 reports kv_dtype {r.get('kv_dtype')}")
        d = first_difference(tokens["full@cuda/f16"], tokens["full@cpu/f16"])
        checks["full@cuda/f16 == full@cpu/f16"] = d == -1
        if d != -1:
            summary["failures"].append(f"{name}: full@cuda/f16 leaves full@cpu/f16 at token {d} (check for a near-tie)")
        d = first_difference(tokens["full@cuda"], tokens["full@cpu"])
        checks["full@cuda == full@cpu"] = d == -1
        if d != -1:
            summary["failures"].append(f"{name}: full@cuda leaves full@cpu at token {d} (check for a near-tie)")
        summary["models"][name] = {
            "checks": checks,
            "decode_tokens_per_s": {k: v["decode_tokens_per_s"] for k, v in runs.items()},
            "hit_rate": runs["dualdecoder@cuda"].get("hit_rate", 0.0),
            "fetched_chunks": {k: v.get("fetched_chunks", 0) for k, v in runs.items()},
        }


if __name__ == "__main__":
    sys.exit(main())
