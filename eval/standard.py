#!/usr/bin/env python3
"""The evaluation with statistical power (docs/decisions/0033-evaluation-methodology.md): many
questions per haystack, the haystack prefilled once per mode, intervals in the report.

    python3 eval/standard.py --quick       # Gemma 2K, one haystack per family (~3 min)
    python3 eval/standard.py --standard    # both models at their long lengths (hours; resumable)

For every haystack (shared_tasks.py): `ddctl answer` in `sparse` at each budget below the
length and in `full`, and `dualdecoder` at one budget on the first haystack of each cell (its
real rows equal sparse's; the report checks the answers match). The runs of one haystack share
a real dd-kv-pool: the first sparse run prefills the context and commits it under its prefix
keys, `full` and the other sparse runs restore it (--prefix_block) instead of prefilling again
(a sparse prefill writes full's KV bit for bit: prefix_reuse_test). On the first haystack of
each model's longest length (one family) `full` also runs prefilling its own context
("full-prefill"); the report checks it answers exactly as the restored `full`.

Each (model, haystack, mode, budget) run is appended to the JSONL results file as one record
(all its answers) as soon as it finishes; running the same command again skips what is there,
so an interrupted run resumes. A record whose haystack differs from what the generator now
makes stops the run (pass --restart). At the end eval/standard_report.py writes
bench/results/eval-standard.{json,md}.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_cli  # noqa: E402
import haystack  # noqa: E402
import jsonl_store  # noqa: E402
from kv_pool import POOL_TOKEN, Pool  # noqa: E402
import models  # noqa: E402
import shared_tasks  # noqa: E402
import standard_report  # noqa: E402

REPO = engine_cli.REPO
SPARSE_GROUP = 6      # slots per batch in sparse modes (each a copy of the context in the pool)
PRESETS = {
    # A "+" joins families that share one haystack (qa_people's facts sit in the prose that
    # continuation continues): one prefill per mode serves both.
    "quick": {"models": {"gemma": [2048]}, "families": ["needle_kv", "qa_people+continuation", "icl_codes"],
              "haystacks": 1, "budgets": [512, 1024], "dual_budget": 512, "check_family": "icl_codes"},
    # 4 haystacks x 13 questions = 52 per (family, length, mode, budget) cell
    # (docs/decisions/0033-evaluation-methodology.md asks for >= 50). Budget 2048 is left to the
    # fidelity runs (the task runs at 2048 showed no loss anywhere, bench/results/eval-standard.md
    # of be6c299): the preset fits 2.5 h.
    "standard": {"models": {"gemma": [2048, 8192, 16384, 32000], "smollm2": [2048, 4096, 8000]},
                 "families": ["qa_people+continuation", "icl_codes"], "haystacks": 4, "questions": 13,
                 "budgets": [512, 1024], "dual_budget": 1024, "check_family": "icl_codes"},
}


def log(msg):
    print(f"[eval-standard] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="preset", action="store_const", const="quick")
    g.add_argument("--standard", dest="preset", action="store_const", const="standard")
    ap.add_argument("--model", help="only this model (short name gemma|smollm2); its preset lengths unless --lengths")
    ap.add_argument("--lengths", help="comma-separated prompt lengths in tokens (with --model)")
    ap.add_argument("--families", help="comma-separated, from: " + ", ".join(shared_tasks.FAMILIES) +
                    " (X+continuation: both on one haystack)")
    ap.add_argument("--haystacks", type=int, help="haystacks per (family, length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bin", default=str(Path(os.environ.get("DD_BUILD_DIR", REPO / "build")) / "bin"))
    ap.add_argument("--results", help="JSONL of run records (default bench/results/eval-standard-<preset>.jsonl)")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--restart", action="store_true", help="delete the results file first instead of resuming")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds allowed per ddctl answer run")
    a = ap.parse_args(argv)
    a.preset = a.preset or "quick"
    p = dict(PRESETS[a.preset])
    a.models = dict(p["models"])
    if a.model:
        if a.model not in models.MODELS:
            ap.error(f"--model: unknown short name {a.model!r}; known: {', '.join(models.MODELS)}")
        a.models = {a.model: a.models.get(a.model, [2048])}
    if a.lengths:
        if not a.model:
            ap.error("--lengths needs --model (lengths are per model)")
        try:
            a.models[a.model] = [int(x) for x in a.lengths.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--lengths: expected comma-separated integers, got {a.lengths!r}")
    a.families = a.families.split(",") if a.families else p["families"]
    unknown = [f for group in a.families for f in group.split("+") if f not in shared_tasks.FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(shared_tasks.FAMILIES)}")
    a.haystacks = a.haystacks if a.haystacks is not None else p["haystacks"]
    if a.haystacks < 1:
        ap.error(f"--haystacks must be >= 1, got {a.haystacks}")
    a.questions = p.get("questions", shared_tasks.QUESTIONS_PER_HAYSTACK)
    a.budgets, a.dual_budget, a.check_family = p["budgets"], p["dual_budget"], p["check_family"]
    for m, lengths in a.models.items():
        for n in lengths:
            if n < 1024:
                ap.error(f"length {n} for {m} is too short for a long-context task (minimum 1024 tokens)")
    a.results = a.results or os.path.join(a.out_dir, f"eval-standard-{a.preset}.jsonl")
    return a


def chat_wrap(model, context, question):
    """SmolLM2 is an instruct model: the question families with an answer cue go through its
    ChatML template (a user turn holding context + question, the cue opening the assistant's
    turn). Document-style families (a list to continue, prose to continue) stay raw text."""
    if model != "smollm2" or "\nAnswer: " not in question.text:
        return context, question, False
    ask, cue = question.text.split("\nAnswer: ", 1)
    head = "<|im_start|>system\nAnswer the question from the text.<|im_end|>\n<|im_start|>user\n"
    text = f"{ask}<|im_end|>\n<|im_start|>assistant\n{cue}"
    return head + context, dataclasses.replace(question, text=text), True


def stable_boundary(model, context, questions):
    """SmolLM2's GPT-2 byte-level BPE splits a whitespace run before a word ("\n\n" + "Each" ->
    "\n", "\nEach"-like pieces) differently from the same run at the end of the text, so a
    choice right after a context ending in "\n\n" would change the context's own last tokens
    (ddctl answer refuses that: the choice's log-likelihood would score a re-tokenized
    context). There the trailing whitespace moves from the shared context into every
    question: the full prompts are the same strings, the shared context ends on a word or
    punctuation. Gemma's SentencePiece tokenizer keeps the boundary and its haystacks stay as
    they were measured."""
    ws = context[len(context.rstrip()):]
    if model != "smollm2" or not ws:
        return context, questions
    moved = []
    for q in questions:
        if q.kind == "choice" and not q.text:
            moved.append(dataclasses.replace(q, choices=tuple(ws + c for c in q.choices)))
        else:
            moved.append(dataclasses.replace(q, text=ws + q.text))
    return context[:len(context) - len(ws)], moved


def run_answer(a, model_path, ctx, qs, mode, budget, pool, timeout):
    """One `ddctl answer` run; returns (context line, answer lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        cf, qf = Path(tmp) / "context.txt", Path(tmp) / "questions.jsonl"
        cf.write_text(ctx)
        qf.write_text("".join(json.dumps(q.request()) + "\n" for q in qs))
        cmd = [str(Path(a.bin) / "ddctl"), "answer", "--model", str(model_path), "--mode", mode,
               "--prompt_file", str(cf), "--questions_file", str(qf)]
        env = dict(os.environ)
        if mode == "full-prefill":
            cmd[cmd.index("--mode") + 1] = "full"
        elif mode != "full":
            # A sparse fork copies the context's KV inside the pool, which reserves every
            # layer's blocks (Gemma at 32K: ~1.1 GiB per copy): fewer copies at once.
            cmd += ["--budget", str(budget), "--answer_group", str(SPARSE_GROUP)]
        if pool is not None:
            cmd += pool.flags()
            env["DD_KV_POOL_TOKEN"] = POOL_TOKEN
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise engine_cli.EngineSetupError(f"ddctl answer did not finish within {timeout} s") from None
        if r.returncode != 0:
            raise engine_cli.EngineSetupError(f"ddctl answer failed (exit {r.returncode}): {r.stderr.strip()[-800:]}")
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        if not lines or lines[0].get("type") != "context" or len(lines) != len(qs) + 1:
            raise engine_cli.EngineSetupError(f"ddctl answer printed {len(lines)} lines for {len(qs)} questions")
        return lines[0], lines[1:]


def make_record(model, h, mode, budget, head, answers, qs, chat, wall_s, git_sha):
    out = []
    for q, ans in zip(qs, answers):
        if ans.get("id") != q.id:
            raise engine_cli.EngineSetupError(f"ddctl answer returned {ans.get('id')!r} where {q.id!r} was expected")
        rec = {"id": q.id, "family": q.family, "correct": bool(q.score(ans))}
        for k in ("text", "tokens", "choice_logprobs", "choice_tokens", "hit_rate_after_first"):
            if k in ans:
                rec[k] = ans[k]
        if q.kind == "choice":
            rec["nll_true"] = -ans["choice_logprobs"][q.answer_index] / max(1, ans["choice_tokens"][q.answer_index])
        out.append(rec)
    return {"task_id": f"{model}:{h.id}", "model": model, "family": h.family, "length": h.length, "index": h.index,
            "seed": h.seed, "haystack_sha": h.sha(), "mode": mode, "budget": budget or None, "chat": chat,
            "context_tokens": head["context_tokens"], "shared_tokens": head["shared_tokens"],
            "prefill_s": round(head["prefill_s"], 3), "prefix_reused_tokens": head.get("prefix_reused_tokens"),
            "wall_s": round(wall_s, 3), "git_sha": git_sha,
            "answers": out}


def jobs_for(a, h, longest):
    """The runs over haystack h, in order: the first sparse run prefills (and commits) the
    context, full and the others restore it."""
    sparse = [("sparse", b) for b in a.budgets if b < h.length]
    jobs = sparse[:1] + [("full", 0)] + sparse[1:]
    if h.index == 0 and a.dual_budget < h.length:
        jobs.append(("dualdecoder", a.dual_budget))
    if h.index == 0 and h.length == longest and h.family == a.check_family:
        jobs.append(("full-prefill", 0))
    return jobs


def run_model(a, model, store):
    engine = engine_cli.Ddctl(str(Path(a.bin) / "ddctl"), model)
    ctx_len = engine.context_length()
    paragraphs = haystack.load_paragraphs()
    lengths = a.models[model]
    for n in lengths:
        if n + 64 > ctx_len:
            raise SystemExit(f"eval-standard: length {n} leaves no room for answers in {model}'s context of {ctx_len}")
    started, done = time.monotonic(), 0
    total_cost = sum(n for n in lengths) * len(a.families) * a.haystacks
    for n in lengths:
        for fam in a.families:
            for i in range(a.haystacks):
                h = shared_tasks.make_haystack(fam, n, i, a.seed, engine.count_tokens, paragraphs, a.questions)
                wrapped = [chat_wrap(model, h.context, q) for q in h.questions]
                ctx, qs, chat = wrapped[0][0], [w[1] for w in wrapped], any(w[2] for w in wrapped)
                ctx, qs = stable_boundary(model, ctx, qs)
                todo = []
                for mode, b in jobs_for(a, h, max(lengths)):
                    key = (f"{model}:{h.id}", mode, b)
                    if store.has(key):
                        if store.records[key]["haystack_sha"] != h.sha():
                            raise SystemExit(f"eval-standard: {store.path} holds another version of {key} (generator, "
                                             "seed or tokenizer changed); pass --restart or another --results file")
                    else:
                        todo.append((mode, b))
                with tempfile.TemporaryDirectory() as tmp:
                    shared = sum(1 for m, _ in todo if m != "full-prefill")
                    pool = Pool(a.bin, tmp) if shared >= 2 else None
                    try:
                        for mode, b in todo:
                            t0 = time.monotonic()
                            head, answers = run_answer(a, engine.model, ctx, qs, mode, b,
                                                       pool if mode != "full-prefill" else None, a.timeout)
                            rec = make_record(model, h, mode, b, head, answers, qs, chat, time.monotonic() - t0,
                                              a.git_sha)
                            store.append(rec)
                            right = sum(x["correct"] for x in rec["answers"])
                            log(f"{model} {h.id} {mode}{'@' + str(b) if b else ''}: {right}/{len(answers)} correct, "
                                f"prefill {head['prefill_s']:.1f} s, {rec['wall_s']:.1f} s")
                    finally:
                        if pool is not None:
                            pool.close()
                done += n
                el = time.monotonic() - started
                log(f"{model}: {done / total_cost:.0%} of the work, elapsed {el / 60:.1f} min, "
                    f"ETA {el / done * (total_cost - done) / 60:.1f} min (this model, this session)")


# The standard preset's other parts (bench/run eval --standard runs them before the tasks):
# results file and the key holding its wall time in seconds.
OTHER_PARTS = [("eval-fidelity-standard", "wall_s"), ("eval-fidelity-standard-smollm2", "wall_s"),
               ("eval-predictors", "seconds"), ("eval-predictors-smollm2", "seconds"),
               ("eval-predictors-families", "seconds")]


def other_parts(out_dir):
    parts = []
    for name, key in OTHER_PARTS:
        p = Path(out_dir) / f"{name}.json"
        if p.is_file():
            j = json.loads(p.read_text())
            if key in j:
                parts.append({"part": name, "wall_s": j[key], "git_sha": j.get("git_sha")})
    return parts


def main(argv=None):
    a = parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    import wrap_results
    a.git_sha = wrap_results.git_sha()
    if a.restart and os.path.exists(a.results):
        os.remove(a.results)
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    try:
        store = jsonl_store.JsonlStore(a.results)
        for model in a.models:
            run_model(a, model, store)
    except (engine_cli.EngineSetupError, haystack.HaystackMissing, jsonl_store.ResultsFileError, ValueError) as e:
        raise SystemExit(f"eval-standard: {e}") from None
    config = {"preset": a.preset, "models": a.models, "families": a.families, "haystacks": a.haystacks,
              "questions_per_haystack": a.questions, "budgets": a.budgets, "dual_budget": a.dual_budget,
              "seed": a.seed, "results_file": os.path.relpath(a.results, REPO),
              "command": "python3 eval/standard.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    wanted = {(m, f, n) for m, ls in a.models.items() for n in ls for f in a.families}
    records = [r for r in store.records.values()
               if (r["model"], r["family"], r["length"]) in wanted and r["index"] < a.haystacks]
    parts = other_parts(a.out_dir) if a.preset == "standard" else []
    for path in standard_report.write(records, config, a.out_dir, parts):
        log(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
