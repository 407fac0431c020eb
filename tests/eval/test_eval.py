"""Tests for the long-context task evaluation (eval/): generator, scorers, resume, bad input.

No model is needed: token counts come from a stand-in tokenizer (words and punctuation, plus
BOS) and the runner is driven through a fake `ddctl` script. One test uses the real tokenizer
and skips when the binary or the model is absent.
"""
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "eval"))
import engine_cli  # noqa: E402
import haystack  # noqa: E402
import jsonl_store  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402
import scoring  # noqa: E402
import tasks  # noqa: E402


def count_tokens(text):
    """Stand-in tokenizer: one token per word or punctuation mark, plus BOS."""
    return len(re.findall(r"\w+|[^\w\s]", text)) + 1


@pytest.fixture(scope="module")
def paragraphs():
    return haystack.load_paragraphs()


@pytest.fixture(scope="module")
def task_set(paragraphs):
    return tasks.generate(tasks.FAMILIES, [2048], 3, 0, count_tokens, paragraphs)


# --- generator ------------------------------------------------------------------------------

def test_same_seed_gives_same_tasks(task_set, paragraphs):
    again = tasks.generate(tasks.FAMILIES, [2048], 3, 0, count_tokens, paragraphs)
    assert again == task_set


def test_different_seed_gives_different_tasks(task_set, paragraphs):
    other = tasks.generate(tasks.FAMILIES, [2048], 3, 1, count_tokens, paragraphs)
    for a, b in zip(task_set, other):
        assert a.family == b.family
        assert a.prompt != b.prompt, a.id
        assert a.expected != b.expected, a.id


def test_tasks_of_one_seed_differ_from_each_other(task_set):
    assert len({t.prompt for t in task_set}) == len(task_set)
    assert len({t.id for t in task_set}) == len(task_set)


def _solve_from_prompt(t):
    """Answers a task by reading only its prompt: the expected answer must be derivable."""
    p, question = t.prompt, t.prompt.rsplit("Question:", 1)[1]
    needles = collections.defaultdict(list)
    for key, value in re.findall(r"special magic numbers? for ([a-z]+-[a-z]+) is: (\d+)\.", p):
        needles[key].append(value)
    asked = re.findall(r"\b([a-z]+-[a-z]+)\b", question)
    if t.family.startswith("needle"):
        return {v for k in asked for v in needles[k]}
    if t.family == "variable_tracking":
        value = re.search(r"the value (\d+) is assigned", question.lower()).group(1)
        assign = dict(re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?(\w+)\.", p))

        def resolve(name):
            while name in assign:
                name = assign[name]
            return name
        return {name for name in assign if resolve(name) == value}
    if t.family == "common_words":
        words = p.split("\n\n")[1].rstrip(".").split(", ")
        counts = collections.Counter(words).most_common()
        assert counts[2][1] > counts[3][1], "top three are not clearly the most common"
        return {w for w, _ in counts[:3]}
    if t.family == "qa":
        name = re.search(r"(?:of|was|does) ([A-Z][a-z]+ [A-Z][a-z]+)", question).group(1)
        facts = [s for s in p.split("\n\n") if name in s and "Question" not in s]
        assert len(facts) == 1, facts
        return {c for c in t.candidates if re.search(rf"\b{c}\.$", facts[0])}
    raise AssertionError(t.family)


def test_expected_answer_is_derivable_from_the_prompt(task_set):
    for t in task_set:
        assert _solve_from_prompt(t) == set(t.expected), t.id


def test_distractors_are_present(task_set):
    by_family = {t.family: t for t in task_set}
    assert len(re.findall(r"special magic number for [a-z]+-[a-z]+ is: \d{7}\.", by_family["needle_multikey"].prompt)) == 4
    assert len(re.findall(r"^VAR ", by_family["variable_tracking"].prompt, re.M)) == 6
    qa_body = by_family["qa"].prompt.rsplit("Question:", 1)[0]
    people = [f"{a} {b}" for a in tasks.FIRST_NAMES for b in tasks.LAST_NAMES if f"{a} {b}" in qa_body]
    assert len(people) == 4


@pytest.mark.parametrize("length", [600, 2048, 8192, 32000])
@pytest.mark.parametrize("family", ["needle_single", "variable_tracking", "common_words", "qa"])
def test_prompt_never_exceeds_target_and_comes_close(family, length, paragraphs):
    t = tasks.make_task(family, length, 0, 0, count_tokens, paragraphs)
    assert t.prompt_tokens == count_tokens(t.prompt)
    assert t.prompt_tokens <= length
    assert t.prompt_tokens >= length - max(100, length // 100)
    assert "\nAnswer:" in t.prompt.rsplit("Question:", 1)[1]


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_fit_comes_within_one_percent_or_takes_all_that_fits(family, paragraphs):
    import random
    spec = tasks.BUILDERS[family](random.Random(family), haystack.vocabulary(paragraphs))
    units = tasks.split_sentences(paragraphs)
    prompt, tokens, n = tasks.fit_prompt(spec, 3000, count_tokens, units, 123)
    assert tokens == count_tokens(prompt) <= 3000
    # Within 1% of the target, or else one more sentence would not fit.
    assert 3000 - tokens <= 30 or count_tokens(tasks.render_prompt(spec, units, 123, n + 1)) > 3000


def test_needles_land_at_their_depths(paragraphs):
    units = tasks.split_sentences(paragraphs)
    body = tasks.render_prose(units, 0, 100, [(0.0, "FIRST NEEDLE."), (1.0, "LAST NEEDLE."), (0.5, "MID NEEDLE.")])
    assert body.startswith("FIRST NEEDLE.\n\n")
    assert body.endswith("LAST NEEDLE.\n\n")
    mid = body.index("MID NEEDLE.")
    assert 0.3 < mid / len(body) < 0.7
    assert " \n\n" not in body


def test_target_below_the_fixed_text_is_refused(paragraphs):
    with pytest.raises(ValueError, match="below the task's fixed text"):
        tasks.make_task("needle_single", 40, 0, 0, count_tokens, paragraphs)


def test_unknown_family_is_refused(paragraphs):
    with pytest.raises(ValueError, match="unknown family 'needle_double'"):
        tasks.make_task("needle_double", 2048, 0, 0, count_tokens, paragraphs)


def test_missing_haystack_names_the_file(tmp_path):
    with pytest.raises(haystack.HaystackMissing, match=re.escape(str(tmp_path / "GPL-3"))):
        haystack.load_paragraphs(directory=str(tmp_path))


def test_real_tokenizer_length_stays_within_target(paragraphs):
    try:
        engine = engine_cli.Ddctl()
    except engine_cli.EngineSetupError as e:
        pytest.skip(str(e))
    for family in ("needle_multivalue", "common_words"):
        t = tasks.make_task(family, 2048, 0, 0, engine.count_tokens, paragraphs)
        assert 2048 - 20 <= t.prompt_tokens <= 2048
        assert engine.count_tokens(t.prompt) == t.prompt_tokens


# --- scorers --------------------------------------------------------------------------------

def test_normalize():
    assert scoring.normalize("  The  Number:\n1234567. ") == "the number 1234567"


@pytest.mark.parametrize("answer,ok", [
    (": 7445784.", True), (" The special magic number is 7445784", True), ("7445784 7445784", True),
    (" 7445785.", False), (" 744578", False), (" 7445784 and 1234567", False), ("", False),
    (" 74457841", False),
])
def test_number_scorer(answer, ok):
    assert scoring.is_correct(answer, ["7445784"], "number") is ok


@pytest.mark.parametrize("answer,ok", [
    (": 1111111, 2222222, and 3333333.", True), ("3333333 1111111 2222222", True),
    (": 1111111, 2222222.", False),                       # partial: one value missing
    (": 1111111, 2222222, 3333333, 3333334.", False),     # one value extra
])
def test_multi_value_scorer_requires_all_values(answer, ok):
    assert scoring.is_correct(answer, ["1111111", "2222222", "3333333"], "number") is ok


@pytest.mark.parametrize("answer,ok", [
    (" Chicago, Illinois.", True), (" chicago", True), (" Barcelona.", False), (" Chicago or Paris", False),
    (" a big city", False),
])
def test_candidate_scorer(answer, ok):
    assert scoring.is_correct(answer, ["Chicago"], "candidate", ["Chicago", "Paris", "Barcelona"]) is ok


def test_every_family_scores_its_own_answer_right_and_a_wrong_one_wrong(task_set):
    for t in task_set:
        assert t.score(" " + ", ".join(t.expected) + "."), t.id
        assert not t.score(" I do not know."), t.id
        if len(t.expected) > 1:
            assert not t.score(" " + ", ".join(t.expected[1:])), t.id   # partial
        wrong = next(c for c in t.candidates if c not in t.expected) if t.kind == "candidate" else "1000000"
        assert not t.score(f" {wrong}."), t.id


# --- results file and resume ----------------------------------------------------------------

def _rec(task_id, mode="full", budget=None, **extra):
    return {"task_id": task_id, "mode": mode, "budget": budget, **extra}


def test_truncated_last_line_and_duplicates_are_handled(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(_rec("a", answer="first")), json.dumps(_rec("a", answer="dup")),
             json.dumps(_rec("a", "sparse", 512))]
    path.write_text("\n".join(lines) + "\n" + json.dumps(_rec("b"))[:17])
    warnings = []
    store = jsonl_store.JsonlStore(str(path), warn=warnings.append)
    assert set(store.records) == {("a", "full", 0), ("a", "sparse", 512)}
    assert store.records[("a", "full", 0)]["answer"] == "first"
    assert any("duplicate" in w for w in warnings) and any("incomplete last line" in w for w in warnings)
    store.append(_rec("b"))
    again = jsonl_store.JsonlStore(str(path), warn=warnings.append)
    assert set(again.records) == {("a", "full", 0), ("a", "sparse", 512), ("b", "full", 0)}
    assert path.read_text().endswith("}\n") and path.read_text().count("\n") == 4


def test_unterminated_but_complete_last_line_is_redone(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_rec("a")) + "\n" + json.dumps(_rec("b")))
    store = jsonl_store.JsonlStore(str(path), warn=lambda m: None)
    assert set(store.records) == {("a", "full", 0)}


def test_damage_before_the_last_line_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_rec("a")) + "\n{\"task_id\n" + json.dumps(_rec("b")) + "\n")
    with pytest.raises(jsonl_store.ResultsFileError, match="line 2"):
        jsonl_store.JsonlStore(str(path))


class FakeEngine:
    def __init__(self):
        self.calls = []

    def generate(self, prompt, mode, budget, max_new_tokens, stop="\n", timeout=0):
        self.calls.append((mode, budget))
        return {"text": " 1234567.", "tokens": [1, 2], "prompt_tokens": 100, "generated_tokens": 2}


def test_run_jobs_skips_finished_entries(tmp_path, task_set):
    t = task_set[0]
    store = jsonl_store.JsonlStore(str(tmp_path / "r.jsonl"))
    jobs = run.jobs_for([t], ["full", "sparse", "dualdecoder"], [512, 1024])
    store.append(run.make_record(t, "sparse", 512, FakeEngine().generate("", "", 0, 0), 1.0))
    engine = FakeEngine()
    run.run_jobs(engine, store, jobs, timeout=10)
    assert sorted(engine.calls) == [("dualdecoder", 512), ("dualdecoder", 1024), ("full", 0), ("sparse", 1024)]
    engine2 = FakeEngine()
    run.run_jobs(engine2, jsonl_store.JsonlStore(store.path), jobs, timeout=10)
    assert engine2.calls == []


def test_resume_refuses_a_changed_task(tmp_path, task_set):
    store = jsonl_store.JsonlStore(str(tmp_path / "r.jsonl"))
    t = task_set[0]
    store.append(dict(run.make_record(t, "full", 0, FakeEngine().generate("", "", 0, 0), 1.0), prompt_sha="0" * 16))
    with pytest.raises(SystemExit, match="different version of task"):
        run.run_jobs(FakeEngine(), store, run.jobs_for([t], ["full"], []), timeout=10)


def test_jobs_skip_budgets_that_cover_the_prompt(task_set):
    jobs = run.jobs_for(task_set[:1], ["full", "sparse"], [512, 2048, 4096])
    assert [(m, b) for _, m, b in jobs] == [("full", 0), ("sparse", 512)]


# --- aggregation ----------------------------------------------------------------------------

def test_aggregate_counts_accuracy_mismatches_and_goal():
    base = {"family": "qa", "length": 4096, "per_layer": [{"layer": 5, "hit_rate": 0.5}], "answer": ""}
    recs = [dict(base, task_id="t1", mode="full", budget=None, correct=True, tokens=[1]),
            dict(base, task_id="t2", mode="full", budget=None, correct=True, tokens=[1]),
            dict(base, task_id="t1", mode="sparse", budget=2048, correct=True, tokens=[1]),
            dict(base, task_id="t2", mode="sparse", budget=2048, correct=False, tokens=[2]),
            dict(base, task_id="t1", mode="dualdecoder", budget=2048, correct=True, tokens=[1], hit_rate=0.9),
            dict(base, task_id="t2", mode="dualdecoder", budget=2048, correct=True, tokens=[3], hit_rate=0.7)]
    agg = report.aggregate(recs)
    full = [r for r in agg["accuracy"] if r["family"] == "qa" and r["mode"] == "full"]
    assert full[0]["accuracy"] == 1.0 and full[0]["n"] == 2
    sparse = [r for r in agg["accuracy"] if r["family"] == "qa" and r["mode"] == "sparse"]
    assert sparse[0]["accuracy"] == 0.5
    assert agg["dual_vs_sparse"]["compared"] == 2 and agg["dual_vs_sparse"]["equal"] == 1
    assert agg["dual_vs_sparse"]["mismatches"][0]["task_id"] == "t2"
    assert agg["hit_rate"]["mean"] == pytest.approx(0.8)
    assert agg["goal"] == [{"family": "qa", "n": 2, "full": 1.0, "sparse": 0.5, "verdict": "missed"}]


# --- bad input through the entry point ------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--families", "needle_double"], "unknown family needle_double"),
    (["--modes", "fast"], "unknown mode fast"),
    (["--budgets", "500"], "not a positive multiple of 8"),
    (["--budgets", "0"], "not a positive multiple of 8"),
    (["--lengths", "2048", "--budgets", "2048"], "not below any task length"),
    (["--lengths", "2k"], "comma-separated integers"),
    (["--lengths", "100"], "too short"),
    (["--per-family", "0"], "--per-family must be >= 1"),
])
def test_bad_arguments_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_argument_from_the_command_line_has_no_traceback():
    r = subprocess.run([sys.executable, str(REPO / "eval" / "run.py"), "--families", "bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "unknown family bogus" in r.stderr and "Traceback" not in r.stderr


FAKE_DDCTL = r'''#!/usr/bin/env python3
import json, re, sys
args = sys.argv[1:]
def flag(name):
    return args[args.index(name) + 1] if name in args else None
with open(__file__ + ".log", "a") as log:
    log.write(" ".join(a for a in args if "\n" not in a) + "\n")
if args[0] == "info":
    print(json.dumps({"name": "fake", "context_length": CONTEXT}))
elif args[0] == "tokenize":
    text = open(flag("--prompt_file")).read()
    print(",".join(["2"] * (len(re.findall(r"\w+|[^\w\s]", text)) + 1)))
elif args[0] == "generate":
    out = {"text": " 1234567.", "tokens": [5, 6], "prompt_tokens": 10, "generated_tokens": 2,
           "stop_reason": "stop_string", "ttft_s": 0.1}
    if flag("--mode") == "dualdecoder":
        out.update(hit_rate=0.9, per_layer=[{"layer": 5, "hit_rate": 0.9}])
    print(json.dumps(out))
'''


def _fake_ddctl(tmp_path, context=32768):
    exe = tmp_path / "ddctl"
    exe.write_text(FAKE_DDCTL.replace("CONTEXT", str(context)))
    exe.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    return exe, model


def test_missing_binary_names_scripts_build(tmp_path):
    with pytest.raises(SystemExit, match="scripts/build"):
        run.main(["--ddctl", str(tmp_path / "nope"), "--out-dir", str(tmp_path)])


def test_missing_model_names_scripts_fetch_model(tmp_path):
    exe, _ = _fake_ddctl(tmp_path)
    with pytest.raises(SystemExit, match="scripts/fetch-model"):
        run.main(["--ddctl", str(exe), "--model", str(tmp_path / "nope.gguf"), "--out-dir", str(tmp_path)])


def test_length_beyond_the_model_context_is_refused(tmp_path):
    exe, model = _fake_ddctl(tmp_path, context=4096)
    with pytest.raises(SystemExit, match="exceeds the model's context of 4096"):
        run.main(["--ddctl", str(exe), "--model", str(model), "--lengths", "2048,8192", "--out-dir", str(tmp_path)])


def test_end_to_end_with_a_fake_ddctl_writes_reports_and_resumes(tmp_path):
    exe, model = _fake_ddctl(tmp_path)
    argv = ["--ddctl", str(exe), "--model", str(model), "--families", "needle_single,qa", "--lengths", "600,1024",
            "--budgets", "256,512", "--per-family", "1", "--out-dir", str(tmp_path / "out"),
            "--results", str(tmp_path / "r.jsonl")]
    run.main(argv)
    generates = [x for x in (tmp_path / "ddctl.log").read_text().splitlines() if x.startswith("generate")]
    # Per family: 600 -> full + 2 x 2 budgets; 1024 -> the same: 10 generations.
    assert len(generates) == 20
    doc = json.loads((tmp_path / "out" / "eval-tasks.json").read_text())
    assert doc["config"]["runs"] == 20
    assert doc["results"]["dual_vs_sparse"] == {"compared": 8, "equal": 8, "mismatches": []}
    needle_full = [r for r in doc["results"]["accuracy"] if r["family"] == "needle_single" and r["mode"] == "full"]
    assert [r["accuracy"] for r in needle_full] == [0.0, 0.0]
    md = (tmp_path / "out" / "eval-tasks.md").read_text()
    assert md.index("Full attention") < md.index("Sparse and dualdecoder")
    assert (tmp_path / "out" / "eval-tasks-accuracy.png").stat().st_size > 0
    assert (tmp_path / "out" / "eval-tasks-hit-rate.png").stat().st_size > 0
    run.main(argv)   # resumes: nothing left to generate
    generates = [x for x in (tmp_path / "ddctl.log").read_text().splitlines() if x.startswith("generate")]
    assert len(generates) == 20


# --- predictors per family --------------------------------------------------------------------

def test_family_predictor_report_averages_and_states_the_goal(tmp_path):
    import argparse
    import predictors
    rates = {"speculative": 0.9, "speculative-fullhead": 0.95, "previous": 0.7, "union": 0.8, "random": 0.5,
             "oracle": 1.0}
    runs = []
    for fam, shift in (("qa", 0.0), ("needle_single", -0.1)):
        for n in (2048, 4096):
            for p, h in rates.items():
                runs.append({"family": fam, "context": n, "predictor": p, "hit_rate": h + shift,
                             "same_tokens_as_speculative": True})
    a = argparse.Namespace(out_dir=str(tmp_path), budget=1024, steps=32, model=None, full=False)
    predictors.write_families(a, runs, 60.0)
    md = (tmp_path / "eval-predictors-families.md").read_text()
    assert "| qa | 2048 | 90.0% | 95.0% | 70.0% | 80.0% | 50.0% | 100.0% |" in md
    assert "| needle_single | 4096 | 80.0% |" in md
    assert "| all | 85.0% | 90.0% | 65.0% |" in md
    assert "goal ≥ 85%: met" in md and "+20.0 points" in md
    doc = json.loads((tmp_path / "eval-predictors-families.json").read_text())
    assert len(doc["runs"]) == len(runs)
    runs[0]["hit_rate"] = 0.1  # one bad context pulls the mean under the goal
    predictors.write_families(a, runs, 60.0)
    assert "goal ≥ 85%: missed" in (tmp_path / "eval-predictors-families.md").read_text()


# --- speculative shortlist hit rates ----------------------------------------------------------

def test_spec_candidate_report_lists_each_shortlist_per_context(tmp_path, monkeypatch):
    import argparse
    import predictors
    monkeypatch.setattr(predictors, "PREDICTORS", list(predictors.PREDICTORS))  # restored after the test
    monkeypatch.setattr(predictors, "PREDICTOR_FLAGS", dict(predictors.PREDICTOR_FLAGS))
    predictors.use_candidate_predictors([0, 4])
    assert predictors.PREDICTORS == ["cand0", "cand4"]
    assert predictors.PREDICTOR_FLAGS["cand4"][-2:] == ["--spec_candidates", "4"]
    runs = [{"context": n, "predictor": p, "hit_rate": h, "same_tokens_as_speculative": True}
            for n, p, h in ((8192, "cand0", 0.96), (16384, "cand0", 0.94), (8192, "cand4", 0.95),
                            (16384, "cand4", 0.87))]
    a = argparse.Namespace(out_dir=str(tmp_path), budget=1024, steps=64, model=None, full=False)
    predictors.write_candidates(a, runs, 60.0)
    md = (tmp_path / "eval-spec-candidates.md").read_text()
    assert "| 0 | 96.0% | 94.0% | 95.0% |" in md
    assert "| 4 | 95.0% | 87.0% | 91.0% |" in md
    assert json.loads((tmp_path / "eval-spec-candidates.json").read_text())["runs"] == runs


def test_int_lists_are_checked_by_flag():
    import predictors
    assert predictors.parse_int_list("0,8,4", "--spec-candidates", 0, 64) == [0, 8, 4]
    for bad in ("4,x", "65", "4,4", "-1"):
        with pytest.raises(ValueError, match="--spec-candidates"):
            predictors.parse_int_list(bad, "--spec-candidates", 0, 64)
