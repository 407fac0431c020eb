"""The standard evaluation's generator (shared_tasks), intervals (stats) and report
(standard_report): no model needed (a stand-in tokenizer, synthetic records)."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))
import shared_tasks  # noqa: E402
import standard  # noqa: E402
import standard_report  # noqa: E402
import stats  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_eval import count_tokens, paragraphs  # noqa: E402,F401  (stand-in tokenizer, haystack fixture)


@pytest.fixture(scope="module")
def stacks(paragraphs):
    return {f: shared_tasks.make_haystack(f, 2048, 0, 0, count_tokens, paragraphs, 12) for f in shared_tasks.FAMILIES}


# --- generator ------------------------------------------------------------------------------

def test_same_seed_same_haystack_other_seed_other(paragraphs, stacks):
    for f, h in stacks.items():
        again = shared_tasks.make_haystack(f, 2048, 0, 0, count_tokens, paragraphs, 12)
        assert again == h and again.sha() == h.sha()
        other = shared_tasks.make_haystack(f, 2048, 0, 1, count_tokens, paragraphs, 12)
        assert other.context != h.context


@pytest.mark.parametrize("family", shared_tasks.FAMILIES)
def test_size_and_question_count(family, stacks):
    h = stacks[family]
    assert len(h.questions) == 12 and len({q.id for q in h.questions}) == 12
    longest = max(count_tokens(h.context + q.text + max(q.choices, key=len, default="")) + q.max_new_tokens
                  for q in h.questions)
    assert 2048 * 0.9 <= longest <= 2048, longest


def test_needle_and_fact_answers_are_in_the_context_once(stacks):
    for f in ("needle_kv", "qa_people"):
        h = stacks[f]
        for q in h.questions:
            (value,) = q.expected
            assert value in h.context
            assert q.score({"text": f" {value}."}) and not q.score({"text": " 1234567."})


def test_icl_codes_asks_only_words_the_listing_never_shows(stacks):
    h = stacks["icl_codes"]
    listed = {line.split(":")[0] for line in h.context.splitlines() if ": " in line}
    codes = {q.expected[0] for q in h.questions}
    assert len(codes) == 4
    for q in h.questions:
        word = q.text.rstrip(":")
        assert word not in listed and q.expected[0] in q.candidates
        # Every listed word of the asked word's kind carries the expected code.
        kind = next(ws for _, ws in shared_tasks._ICL_CATEGORIES if word in ws)
        assert {line.split(": ")[1] for line in h.context.splitlines()
                if ": " in line and line.split(": ")[0] in kind} == {q.expected[0]}
    # Balanced over the four kinds.
    kinds = [next(n for n, ws in shared_tasks._ICL_CATEGORIES if q.text.rstrip(":") in ws) for q in h.questions]
    assert all(kinds.count(k) == 3 for k in set(kinds))


def test_continuation_truth_follows_the_context_and_distractors_do_not(stacks, paragraphs):
    h = stacks["continuation"]
    units = [u for u, _ in shared_tasks.tasks.split_sentences(paragraphs)]
    for j, q in enumerate(h.questions):
        assert q.kind == "choice" and len(q.choices) == 2
        truth = q.choices[q.answer_index].strip()
        assert len(truth.split()) <= shared_tasks.CONTINUATION_WORDS
        # The lead grows by one sentence per question; the truth starts where it ends.
        if j:
            prev = h.questions[j - 1]
            assert q.text.startswith(prev.text) and len(q.text) > len(prev.text)
            assert q.text[len(prev.text):].strip().startswith(prev.choices[prev.answer_index].split()[0])
        first = truth.split()[0]
        assert any(u.startswith(first) for u in units)
        other = q.choices[1 - q.answer_index].strip()
        assert other != truth
    right = {"choice_logprobs": [-1.0, -2.0], "choice_tokens": [10, 10]}
    q0 = h.questions[0]
    assert q0.score(right) == (q0.answer_index == 0)
    # Per-token, not summed: a long choice with a lower sum but a higher mean wins.
    assert q0.score({"choice_logprobs": [-30.0, -5.0], "choice_tokens": [30, 2]}) == (q0.answer_index == 0)


def test_unknown_family_is_refused(paragraphs):
    with pytest.raises(ValueError, match="unknown family"):
        shared_tasks.make_haystack("nope", 2048, 0, 0, count_tokens, paragraphs)


def test_smollm2_question_families_use_chatml(stacks):
    h = stacks["qa_people"]
    ctx, q, chat = standard.chat_wrap("smollm2", h.context, h.questions[0])
    assert chat and ctx.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in ctx
    assert "<|im_end|>\n<|im_start|>assistant\n" in q.text and q.text.endswith(h.questions[0].text.split("Answer: ")[1])
    for fam in ("icl_codes", "continuation"):
        assert standard.chat_wrap("smollm2", stacks[fam].context, stacks[fam].questions[0])[2] is False
    assert standard.chat_wrap("gemma", h.context, h.questions[0])[2] is False


# --- intervals ------------------------------------------------------------------------------

def test_wilson_known_values():
    lo, hi = stats.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert stats.wilson(0, 0) == (0.0, 1.0)
    lo, hi = stats.wilson(50, 50)
    assert hi == 1.0 and lo == pytest.approx(0.9287, abs=1e-3)
    with pytest.raises(ValueError):
        stats.wilson(11, 10)


def test_paired_difference_of_identical_answers_is_exactly_zero():
    pairs = {i: [(1, 1), (0, 0), (1, 1)] for i in range(5)}
    d = stats.paired_difference(pairs, resamples=500)
    assert d["diff"] == 0 and d["low"] == 0 and d["high"] == 0 and d["n"] == 15 and d["clusters"] == 5
    assert stats.verdict(d) == "no measurable loss"


def test_binary_interval_widens_only_the_side_never_observed():
    d = stats.paired_difference({i: [(1, 0)] + [(1, 1)] * 15 for i in range(4)}, binary=True)
    assert d["low"] == pytest.approx(-1 / 16) and d["high"] == pytest.approx(-1 / 16 + 3 / 64)


def test_binary_interval_is_never_narrower_than_the_rule_of_three():
    few = stats.paired_difference({i: [(1, 1)] * 8 for i in range(4)}, binary=True)
    assert few["low"] == pytest.approx(-3 / 32) and stats.verdict(few) == "not enough evidence"
    many = stats.paired_difference({i: [(1, 1)] * 16 for i in range(4)}, binary=True)
    assert many["low"] == pytest.approx(-3 / 64) and stats.verdict(many) == "no measurable loss"


def test_binary_interval_sees_a_loss_and_a_gain_that_cancel_in_one_haystack():
    # One haystack loses one question and gains another: every bootstrap resample sums to 0.
    pairs = {0: [(1, 0), (0, 1)] + [(1, 1)] * 14, **{i: [(1, 1)] * 16 for i in range(1, 4)}}
    d = stats.paired_difference(pairs, binary=True)
    assert d["diff"] == 0 and d["low"] == pytest.approx(-3 / 64) and d["high"] == pytest.approx(3 / 64)


def test_paired_difference_detects_a_consistent_loss():
    pairs = {i: [(1, 0)] * 3 + [(1, 1)] * 7 for i in range(8)}   # 30 points lost in every haystack
    d = stats.paired_difference(pairs, resamples=2000)
    assert d["diff"] == pytest.approx(-0.3)
    assert d["low"] == pytest.approx(-0.3) and d["high"] == pytest.approx(-0.3)
    assert stats.verdict(d).startswith("loss of 30.0")


def test_cluster_bootstrap_is_wider_than_question_level_when_haystacks_disagree():
    pairs = {i: [(1, 0 if i % 2 else 1)] * 10 for i in range(6)}   # whole haystacks lost or kept
    d = stats.paired_difference(pairs, resamples=4000, seed=3)
    n = 60
    p = 0.5
    se_naive = math.sqrt(p * (1 - p) / n)
    assert (d["high"] - d["low"]) / 2 > 1.5 * 1.96 * se_naive
    assert d["low"] < -0.5 < d["high"]
    # The bootstrap is seeded: same seed, same interval.
    assert stats.paired_difference(pairs, resamples=4000, seed=3) == d


def test_verdict_without_enough_data():
    assert stats.verdict(stats.paired_difference({0: [(1, 1)]})) == "not enough evidence"
    wide = {"diff": -0.05, "low": -0.3, "high": 0.1}
    assert stats.verdict(wide) == "not enough evidence"
    assert stats.verdict({"diff": 0.2, "low": 0.1, "high": 0.3}).startswith("gain of 20.0")


# --- report ---------------------------------------------------------------------------------

def _rec(model, fam, length, index, mode, budget, correct, tokens=None, nll=None, hit=None):
    answers = []
    for j, c in enumerate(correct):
        a = {"id": f"{fam}/{length}/{index}/q{j}", "correct": bool(c), "tokens": (tokens or [[j]] * len(correct))[j]}
        if nll is not None:
            a["nll_true"] = nll[j]
            a["choice_logprobs"] = [-nll[j], -9.0]
        if hit is not None:
            a["hit_rate_after_first"] = hit
        answers.append(a)
    return {"model": model, "family": fam, "length": length, "index": index, "mode": mode, "budget": budget or None,
            "answers": answers, "wall_s": 1.0}


def test_aggregate_pairs_questions_flags_cells_and_checks_dual():
    recs = []
    for i in range(3):
        recs.append(_rec("gemma", "qa_people", 2048, i, "full", 0, [1, 1, 1, 0]))
        recs.append(_rec("gemma", "qa_people", 2048, i, "sparse", 512, [1, 1, 0, 0]))
        recs.append(_rec("gemma", "needle_kv", 2048, i, "full", 0, [0, 0, 0, 1]))
        recs.append(_rec("gemma", "needle_kv", 2048, i, "sparse", 512, [0, 0, 0, 0]))
    recs.append(_rec("gemma", "qa_people", 2048, 0, "dualdecoder", 512, [1, 1, 0, 0], hit=0.9))
    recs.append(_rec("gemma", "qa_people", 2048, 1, "dualdecoder", 512, [1, 1, 0, 0], tokens=[[9], [1], [2], [3]]))
    res = standard_report.aggregate(recs)
    cells = {c["family"]: c for c in res["cells"]}
    qa, nk = cells["qa_people"], cells["needle_kv"]
    assert qa["full"]["n"] == 12 and qa["full"]["accuracy"] == pytest.approx(0.75) and qa["eligible"]
    assert not nk["eligible"]
    b = qa["budgets"]["512"]
    assert b["accuracy"] == pytest.approx(0.5) and b["diff"]["diff"] == pytest.approx(-0.25)
    # A loss in every haystack: the low side is the bootstrap's; no pair gained, so the high
    # side is widened by 3/n (25 points here) and reaches 0.
    assert b["diff"]["low"] == pytest.approx(-0.25) and b["diff"]["high"] == pytest.approx(0.0)
    assert b["verdict"] == "not enough evidence"
    # The pooled verdict uses eligible cells only (needle_kv's loss does not count).
    (v,) = res["verdicts"]
    assert v["diff"]["n"] == 12 and v["diff"]["diff"] == pytest.approx(-0.25)
    same = {(x["index"]): x["same_as_sparse"] for x in res["dual_checks"]}
    assert same == {0: 4, 1: 3}
    md = standard_report.markdown({"config": {"preset": "quick", "command": "x", "haystacks": 3,
                                              "questions_per_haystack": 4},
                                   "git_sha": "abc", "date": "2026-12-02T00:00", "machine": {}, "results": res})
    assert md.index("Full attention") < md.index("Sparse minus full") < md.index("Verdict per budget")
    assert "7 of 8 questions" in md


def test_aggregate_continuation_nll_difference():
    recs = [_rec("gemma", "continuation", 2048, i, "full", 0, [1, 1], nll=[2.0, 3.0]) for i in range(2)]
    recs += [_rec("gemma", "continuation", 2048, i, "sparse", 512, [1, 1], nll=[2.5, 3.5]) for i in range(2)]
    res = standard_report.aggregate(recs)
    (cell,) = res["cells"]
    assert cell["full"]["nll_mean"] == pytest.approx(2.5)
    assert cell["budgets"]["512"]["nll_diff"]["diff"] == pytest.approx(0.5)


def test_two_families_share_a_haystack_and_a_cluster(paragraphs):
    h = shared_tasks.make_haystack("qa_people+continuation", 2048, 0, 0, count_tokens, paragraphs, 6)
    fams = [q.family for q in h.questions]
    assert fams == ["qa_people"] * 6 + ["continuation"] * 6
    for q in h.questions[:6]:
        assert q.expected[0] in h.context and (h.context + q.text).count("\n\nQuestion:") == 1
    assert max(shared_tasks._prompt_tokens(count_tokens, h.context, q) for q in h.questions) <= 2048
    with pytest.raises(ValueError):
        shared_tasks.make_haystack("icl_codes+continuation", 2048, 0, 0, count_tokens, paragraphs, 6)
    # One record, two families: split into two cells; the pooled verdict clusters by haystack.
    recs = []
    for i in range(2):
        for mode, b, ok in (("full", 0, 1), ("sparse", 512, 0)):
            r = _rec("gemma", "qa_people+continuation", 2048, i, mode, b, [ok] * 4)
            for j, a in enumerate(r["answers"]):
                a["family"] = "qa_people" if j < 2 else "continuation"
            recs.append(r)
    res = standard_report.aggregate(recs)
    assert sorted(c["family"] for c in res["cells"]) == ["continuation", "qa_people"]
    (v,) = res["verdicts"]
    assert v["diff"]["clusters"] == 2 and v["diff"]["n"] == 8


def test_restored_full_is_checked_against_a_prefilled_full_and_time_is_summed():
    recs = [_rec("gemma", "icl_codes", 8192, i, "full", 0, [1, 1, 0]) for i in range(2)]
    recs[0]["prefix_reused_tokens"] = 7936
    recs.append(_rec("gemma", "icl_codes", 8192, 0, "full-prefill", 0, [1, 1, 0], tokens=[[0], [5], [2]]))
    recs += [_rec("gemma", "icl_codes", 8192, i, "sparse", 512, [1, 1, 0]) for i in range(2)]
    res = standard_report.aggregate(recs)
    (check,) = res["full_checks"]
    assert check["same_as_full"] == 2 and check["questions"] == 3 and check["restored_tokens"] == 7936
    (cell,) = res["cells"]
    assert cell["full"]["n"] == 6  # the check run is not counted as full's answers
    doc = {"config": {"preset": "standard", "command": "x", "haystacks": 2, "questions_per_haystack": 3},
           "git_sha": "abc", "date": "2026-12-02T00:00", "machine": {}, "results": res,
           "task_time": {"gemma": (600.0, ["abc"])}, "parts": [{"part": "eval-fidelity-standard", "wall_s": 300.0}]}
    md = standard_report.markdown(doc)
    assert "identically on 2 of 3 questions" in md
    assert "| tasks, gemma | 10.0 |" in md and "| **total** | **15.0** |" in md


def test_jobs_restore_after_the_first_sparse_run_and_check_full_once():
    a = standard.parse_args(["--standard"])

    class H:
        def __init__(self, family, length, index):
            self.family, self.length, self.index = family, length, index

    assert standard.jobs_for(a, H("icl_codes", 32000, 0), 32000) == [
        ("sparse", 512), ("full", 0), ("sparse", 1024), ("dualdecoder", 1024), ("full-prefill", 0)]
    assert standard.jobs_for(a, H("icl_codes", 8192, 1), 32000) == [("sparse", 512), ("full", 0), ("sparse", 1024)]
    assert standard.jobs_for(a, H("qa_people+continuation", 32000, 0), 32000)[-1] == ("dualdecoder", 1024)
    assert standard.jobs_for(a, H("icl_codes", 1024, 0), 1024) == [("sparse", 512), ("full", 0), ("full-prefill", 0)]


def test_report_plots_a_cell_at_100_percent(tmp_path):
    """The Wilson bound at 13/13 rounds a hair below 1.0; the error bar must not go negative."""
    recs = [_rec("gemma", "icl_codes", 2048, 0, mode, b, [1] * 13) for mode, b in (("full", 0), ("sparse", 512))]
    config = {"preset": "quick", "command": "x", "haystacks": 1, "questions_per_haystack": 13}
    paths = standard_report.write(recs, config, str(tmp_path))
    assert any(p.endswith(".png") for p in paths) and (tmp_path / "eval-standard-quick.md").is_file()
