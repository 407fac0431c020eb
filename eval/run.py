#!/usr/bin/env python3
"""Long-context task evaluation through the public CLI: full vs sparse vs dualdecoder.

    python3 eval/run.py --quick            # ~8 min on 2 cores (see eval/README.md)
    python3 eval/run.py --full             # 2K-32K, budgets 512/1024/2048 (hours on a CPU)
    python3 eval/run.py --quick --families qa,needle_single --lengths 2048

Every generation is appended to a JSONL file (default bench/results/eval-tasks-<preset>.jsonl);
running the same command again skips what is already there, so an interrupted run resumes.
At the end the records of this configuration are aggregated into bench/results/eval-tasks.json,
eval-tasks.md and plots.
"""
import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_cli  # noqa: E402
import haystack  # noqa: E402
import jsonl_store  # noqa: E402
import report  # noqa: E402
import tasks  # noqa: E402

REPO = engine_cli.REPO
MODES = ("full", "sparse", "dualdecoder")
PRESETS = {
    # 7 families x 1 task x 2 lengths = 14 tasks, 56 generations (budget 2048 runs at 4K only:
    # at 2K it would cover the prompt); ~8 min on 2 idle cores.
    "quick": {"lengths": [2048, 4096], "per_family": 1, "budgets": [512, 2048]},
    # 70 tasks, 462 generations; 32000, not 32768, so the answer fits the 32K context too.
    # Prefill dominates: ~6-8 h on 2 cores.
    "full": {"lengths": [2048, 4096, 8192, 16384, 32000], "per_family": 2, "budgets": [512, 1024, 2048]},
}


def log(msg):
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def _int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _name_list(known, what):
    def parse(text):
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in names if x not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                                             f"known: {', '.join(known)}")
        return names
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = ap.add_mutually_exclusive_group()
    preset.add_argument("--quick", dest="preset", action="store_const", const="quick")
    preset.add_argument("--full", dest="preset", action="store_const", const="full")
    ap.add_argument("--families", type=_name_list(tasks.FAMILIES, "family"), default=list(tasks.FAMILIES))
    ap.add_argument("--lengths", type=_int_list, help="target prompt tokens, e.g. 2048,4096 (preset's otherwise)")
    ap.add_argument("--budgets", type=_int_list, help="sparse budgets in tokens, multiples of 8")
    ap.add_argument("--per-family", type=int, help="tasks per family and length")
    ap.add_argument("--modes", type=_name_list(MODES, "mode"), default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ddctl", help="ddctl binary (default build/bin/ddctl)")
    ap.add_argument("--model", help="model file or short name gemma|smollm2 (default $DD_MODEL, else gemma)")
    ap.add_argument("--results", help="JSONL of per-generation records (default bench/results/eval-tasks-<preset>.jsonl)")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--restart", action="store_true", help="delete the results file first instead of resuming")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds allowed per generation")
    a = ap.parse_args(argv)
    a.preset = a.preset or "quick"
    p = PRESETS[a.preset]
    a.lengths = a.lengths or p["lengths"]
    a.budgets = a.budgets or p["budgets"]
    a.per_family = a.per_family if a.per_family is not None else p["per_family"]
    a.results = a.results or os.path.join(a.out_dir, f"eval-tasks-{a.preset}.jsonl")
    if a.per_family < 1:
        ap.error(f"--per-family must be >= 1, got {a.per_family}")
    for n in a.lengths:
        if n < 512:
            ap.error(f"--lengths: {n} is too short for a long-context task (minimum 512 tokens)")
    for b in a.budgets:
        if b <= 0 or b % 8:
            ap.error(f"--budgets: {b} is not a positive multiple of 8 (sparse attention selects 8-token chunks)")
        if b >= max(a.lengths):
            ap.error(f"--budgets: {b} is not below any task length (largest {max(a.lengths)}); "
                     "sparse attention would cover the whole prompt")
    return a


def check_context(a, context_length):
    longest_answer = 40   # the largest max_new_tokens of any family
    for n in a.lengths:
        if n + longest_answer > context_length:
            raise SystemExit(f"eval: length {n} plus up to {longest_answer} answer tokens exceeds the model's "
                             f"context of {context_length} tokens (ddctl info: context_length); use at most "
                             f"{context_length - longest_answer}")


def jobs_for(task_list, modes, budgets):
    """(task, mode, budget) in run order: per task full first, then each budget's sparse, dual."""
    out = []
    for t in task_list:
        for mode in modes:
            for b in ([0] if mode == "full" else budgets):
                if mode == "full" or b < t.length:
                    out.append((t, mode, b))
    return out


def make_record(task, mode, budget, r, wall_s):
    rec = {"task_id": task.id, "family": task.family, "length": task.length, "index": task.index,
           "seed": task.seed, "prompt_sha": task.prompt_sha(), "prompt_tokens": r["prompt_tokens"],
           "mode": mode, "budget": budget or None, "expected": list(task.expected), "answer": r["text"],
           "correct": task.score(r["text"]), "tokens": r["tokens"], "wall_s": round(wall_s, 3)}
    for k in ("generated_tokens", "stop_reason", "ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s",
              "hit_rate", "per_layer", "budget_tokens", "fetched_chunks", "prefetch_bytes", "urgent_bytes",
              "wasted_bytes"):
        if k in r:
            rec[k] = r[k]
    return rec


def _clock(s):
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def run_jobs(engine, store, jobs, timeout):
    todo = []
    for t, mode, b in jobs:
        key = (t.id, mode, b)
        if store.has(key):
            if store.records[key].get("prompt_sha") != t.prompt_sha():
                raise SystemExit(f"eval: {store.path} holds a different version of task {t.id} (the generator, "
                                 "seed or tokenizer changed); pass --restart or another --results file")
        else:
            todo.append((t, mode, b))
    log(f"{len(jobs)} generations, {len(jobs) - len(todo)} already in {store.path}, {len(todo)} to run")
    # Time per generation is roughly proportional to prompt length (prefill dominates).
    cost_left = sum(t.length for t, _, _ in todo)
    cost_done, start = 0, time.monotonic()
    for i, (t, mode, b) in enumerate(todo, 1):
        t0 = time.monotonic()
        r = engine.generate(t.prompt, mode, b, t.max_new_tokens, stop=t.stop, timeout=timeout)
        rec = make_record(t, mode, b, r, time.monotonic() - t0)
        store.append(rec)
        cost_done += t.length
        cost_left -= t.length
        elapsed = time.monotonic() - start
        eta = elapsed / cost_done * cost_left
        cond = report.condition(rec)
        log(f"{i}/{len(todo)} {t.id} {cond}: {'correct' if rec['correct'] else 'wrong'} "
            f"{rec['answer'].strip()[:40]!r} ({rec['wall_s']:.1f} s) | elapsed {_clock(elapsed)}, ETA {_clock(eta)}")


def main(argv=None):
    a = parse_args(argv)
    try:
        engine = engine_cli.Ddctl(a.ddctl, a.model)
        info = engine.info()
        check_context(a, engine.context_length())
        paragraphs = haystack.load_paragraphs()
        started = time.monotonic()
        log(f"generating {len(a.families) * len(a.lengths) * a.per_family} tasks (seed {a.seed}) ...")
        task_list = tasks.generate(a.families, a.lengths, a.per_family, a.seed, engine.count_tokens, paragraphs)
        if a.restart and os.path.exists(a.results):
            os.remove(a.results)
        os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
        store = jsonl_store.JsonlStore(a.results)
        jobs = jobs_for(task_list, a.modes, a.budgets)
        run_jobs(engine, store, jobs, a.timeout)
    except (engine_cli.EngineSetupError, haystack.HaystackMissing, jsonl_store.ResultsFileError, ValueError) as e:
        raise SystemExit(f"eval: {e}") from None
    keys = {(t.id, m, b) for t, m, b in jobs}
    records = [r for k, r in store.records.items() if k in keys]
    wall = sum(r["wall_s"] for r in records)
    sys.path.insert(0, str(REPO / "bench"))
    import wrap_results  # machine() and git_sha(), shared with the other benchmarks
    doc = {"benchmark": "eval-tasks", "preset": a.preset,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "git_sha": wrap_results.git_sha(), "machine": wrap_results.machine(),
           "config": {"model": info.get("name", str(engine.model)), "model_path": str(engine.model),
                      "ddctl": str(engine.exe),
                      "context_length": engine.context_length(), "families": a.families, "lengths": a.lengths,
                      "budgets": a.budgets, "modes": a.modes, "per_family": a.per_family, "seed": a.seed,
                      "tasks": len(task_list), "runs": len(records), "wall_s": wall,
                      "this_session_s": time.monotonic() - started, "results_file": os.path.relpath(a.results, REPO)},
           "results": report.aggregate(records)}
    for path in report.write(doc, a.out_dir):
        log(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
