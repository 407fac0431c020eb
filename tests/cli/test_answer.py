"""`ddctl answer`: many questions over one context, the context prefilled once.

The answers must equal `ddctl generate` on context + question as one prompt, in every mode,
and the choice log-likelihoods must equal a hand-made teacher-forced sum (via sparse ==
dualdecoder and full's own generate logits). Uses the real Gemma model (a failure when it is
missing and DD_REQUIRE_MODEL is set, else a skip); bad input uses the tiny synthetic model.
"""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ddctl import REPO, ddctl, tiny  # noqa: E402,F401

sys.path.insert(0, str(REPO / "tests" / "reference"))
from test_reference import real_model_path  # noqa: E402  (fails when DD_REQUIRE_MODEL is set)


def real_model():
    return real_model_path("gemma")


CONTEXT = (Path("/usr/share/common-licenses/GPL-3").read_text()[:5000] +
           "\n\nThe special magic number for wise-raven is: 7445784.\n\n" +
           Path("/usr/share/common-licenses/Apache-2.0").read_text()[:2500] + "\n\n")
QUESTIONS = [
    {"id": "magic", "text": "Question: What is the special magic number for wise-raven?\n"
                            "Answer: The special magic number for wise-raven is", "max_new_tokens": 12, "stop": ["\n"]},
    {"id": "which", "text": "Question: Which license is quoted first above?\nAnswer: The", "max_new_tokens": 8,
     "stop": ["\n"], "choices": [" GNU General Public License", " MIT license"]},
    {"id": "long", "text": "Question: Summarize the text above in one sentence.\nAnswer:", "max_new_tokens": 20},
]


def write_inputs(tmp_path, questions=QUESTIONS, context=CONTEXT):
    c, q = tmp_path / "context.txt", tmp_path / "questions.jsonl"
    c.write_text(context)
    q.write_text("".join(json.dumps(x) + "\n" for x in questions))
    return c, q


def answer(model, c, q, *flags):
    r = ddctl("answer", "--model", str(model), "--prompt_file", str(c), "--questions_file", str(q), *flags, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["type"] == "context"
    return lines[0], {x["id"]: x for x in lines[1:]}


@pytest.mark.parametrize("mode", ["full", "sparse", "dualdecoder"])
def test_answers_equal_generate_on_the_whole_prompt(mode, tmp_path):
    model = real_model()
    c, q = write_inputs(tmp_path)
    flags = ["--mode", mode] + ([] if mode == "full" else ["--budget", "256"])
    head, got = answer(model, c, q, *flags)
    assert head["questions"] == len(QUESTIONS)
    assert head["shared_tokens"] >= head["context_tokens"] - 1
    assert head["prefix_reused_tokens"] == 0   # no pool, nothing to restore
    for x in QUESTIONS:
        p = tmp_path / f"prompt-{x['id']}.txt"
        p.write_text(CONTEXT + x["text"])
        args = ["generate", "--model", str(model), "--prompt_file", str(p), "--json",
                "--max_new_tokens", str(x["max_new_tokens"])] + flags
        if "stop" in x:
            args += ["--stop", ",".join(x["stop"])]
        r = ddctl(*args, timeout=600)
        assert r.returncode == 0, r.stderr
        want = json.loads(r.stdout)
        assert got[x["id"]]["tokens"] == want["tokens"], (x["id"], got[x["id"]]["text"], want["text"])
        assert got[x["id"]]["text"] == want["text"]
        assert got[x["id"]]["prompt_tokens"] == want["prompt_tokens"]
    assert "7445784" in got["magic"]["text"]
    lp = got["which"]["choice_logprobs"]
    assert len(lp) == 2 and all(v < 0 for v in lp) and lp[0] > lp[1], lp


def test_choice_logprob_matches_generate_with_the_choice_forced(tmp_path):
    """A one-token choice's log-probability is the log-softmax of the prompt's last logits:
    `ddctl logits` on the whole prompt gives those logits independently."""
    model = real_model()
    c, q = write_inputs(tmp_path, [{"id": "t", "text": "Question: Is this a license?\nAnswer:",
                                    "choices": [" Yes", " No"]}])
    _, got = answer(model, c, q)
    (tmp_path / "p.txt").write_text(CONTEXT + "Question: Is this a license?\nAnswer:")
    prompt = ddctl("tokenize", "--model", str(model), "--prompt_file", str(tmp_path / "p.txt")).stdout.strip()
    (tmp_path / "y.txt").write_text(CONTEXT + "Question: Is this a license?\nAnswer: Yes")
    yes = ddctl("tokenize", "--model", str(model), "--prompt_file", str(tmp_path / "y.txt")).stdout.strip().split(",")
    toks = prompt.split(",")
    assert yes[: len(toks)] == toks and len(yes) == len(toks) + 1, "' Yes' must be one token after the prompt"
    out = tmp_path / "logits.npy"
    r = ddctl("logits", "--model", str(model), "--tokens", prompt, "--positions", str(len(toks) - 1), "--out", str(out))
    assert r.returncode == 0, r.stderr
    import numpy as np
    row = np.load(out)[0].astype(np.float64)
    want = row[int(yes[-1])] - (row.max() + np.log(np.exp(row - row.max()).sum()))
    assert got["t"]["choice_logprobs"][0] == pytest.approx(want, abs=1e-4)
    assert got["t"]["choice_tokens"] == [1, 1]


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not a JSON object"),
    ('{"text": "x", "max_new_tokens": 4}', '"id"'),
    ('{"id": "a", "text": "x", "max_new_tokens": 100000}', "outside [0, 1024]"),
    ('{"id": "a", "text": "x"}', "nothing to do"),
    ('{"id": "a", "text": "x", "choices": [""]}', "empty string"),
    ('{"id": "a", "text": "x", "choices": ' + json.dumps(["a"] * 40) + '}', "at most 15"),
    ('{"id": "a", "text": "x", "stop": "oops", "max_new_tokens": 2}', '"stop" is not an array'),
])
def test_bad_questions_are_named(tiny, tmp_path, line, message):  # noqa: F811
    c = tmp_path / "c.txt"
    c.write_text("hello world " * 20)
    q = tmp_path / "q.jsonl"
    q.write_text(line + "\n")
    r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c), "--questions_file", str(q))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr, r.stderr


def test_group_size_is_bounded(tiny, tmp_path):  # noqa: F811
    c, q = tmp_path / "c.txt", tmp_path / "q.jsonl"
    c.write_text("hello world " * 20)
    q.write_text(json.dumps({"id": "a", "text": " x", "max_new_tokens": 2}) + "\n")
    for bad in ("0", "65"):
        r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c), "--questions_file", str(q), "--answer_group", bad)
        assert r.returncode == 2 and "--answer_group must be in [1, 64]" in r.stderr, r.stderr


def test_missing_inputs_are_named(tiny, tmp_path):  # noqa: F811
    c = tmp_path / "c.txt"
    c.write_text("hello world")
    r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c))
    assert r.returncode != 0 and "--questions_file" in r.stderr, r.stderr
    r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c), "--questions_file", str(tmp_path / "none.jsonl"))
    assert r.returncode != 0 and "none.jsonl" in r.stderr, r.stderr
    (tmp_path / "empty.jsonl").write_text("\n")
    r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c), "--questions_file", str(tmp_path / "empty.jsonl"))
    assert r.returncode == 2 and "holds no question" in r.stderr, r.stderr


def test_question_beyond_the_context_is_refused(tiny, tmp_path):  # noqa: F811
    n_ctx = json.loads(ddctl("info", "--model", str(tiny)).stdout)["context_length"]
    per = len(ddctl("tokenize", "--model", str(tiny), "--text", "hello world " * 10).stdout.strip().split(",")) / 10
    c = tmp_path / "c.txt"
    c.write_text("hello world " * int((n_ctx - 600) / per))   # fits; with 1024 more it does not
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"id": "a", "text": " again", "max_new_tokens": 1024}) + "\n")
    r = ddctl("answer", "--model", str(tiny), "--prompt_file", str(c), "--questions_file", str(q))
    assert r.returncode == 2 and "exceed the model context" in r.stderr, r.stderr


def test_sparse_runs_share_the_context_through_a_real_pool(tmp_path):
    """The evaluation's budgets restore the context from a dd-kv-pool: the second run must
    restore (not prefill) it and answer exactly as without a pool, at another budget too."""
    model = real_model()
    sys.path.insert(0, str(REPO / "eval"))
    import kv_pool
    c, q = write_inputs(tmp_path)
    _, alone = answer(model, c, q, "--mode", "sparse", "--budget", "512")
    env = dict(os.environ, DD_KV_POOL_TOKEN=kv_pool.POOL_TOKEN)
    with kv_pool.Pool(REPO / "build" / "bin" if "DD_BIN_DIR" not in os.environ else os.environ["DD_BIN_DIR"],
                      tmp_path) as pool:
        runs = []
        for budget in ("256", "512"):
            r = ddctl("answer", "--model", str(model), "--prompt_file", str(c), "--questions_file", str(q),
                      "--mode", "sparse", "--budget", budget, *pool.flags(), env=env, timeout=600)
            assert r.returncode == 0, r.stderr
            runs.append([json.loads(x) for x in r.stdout.splitlines()])
    first, second = runs
    assert first[0]["prefix_reused_tokens"] == 0
    assert second[0]["prefix_reused_tokens"] >= second[0]["shared_tokens"] - 256
    restored = {x["id"]: x for x in second[1:]}
    for qid, want in alone.items():
        assert restored[qid]["tokens"] == want["tokens"]
        assert restored[qid].get("choice_logprobs") == want.get("choice_logprobs")


def test_eval_pool_dies_with_the_script_that_started_it():
    """A script that exits without closing its pool (an error path) must not leave it running."""
    import subprocess
    import time
    code = ("import os, sys, tempfile; sys.path.insert(0, sys.argv[1]); import kv_pool; "
            "p = kv_pool.Pool(sys.argv[2], tempfile.mkdtemp()); print(p.proc.pid, flush=True); os._exit(0)")
    bin_dir = os.environ.get("DD_BIN_DIR", str(REPO / "build" / "bin"))
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "eval"), bin_dir], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    stat = Path(f"/proc/{int(r.stdout)}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the pool outlived its parent"


def test_smollm2_choice_after_a_paragraph_break(tmp_path):
    """SmolLM2's byte-level BPE tokenizes "\\n\\n" at the end of a text differently from "\\n\\n"
    before a word: a choice right after such a context is refused (its log-likelihood would
    score re-tokenized context), and the standard evaluation's stable_boundary moves the
    whitespace into the questions so the same prompts run."""
    sys.path.insert(0, str(REPO / "eval"))
    import shared_tasks  # noqa: E402
    import standard  # noqa: E402
    model = real_model_path("smollm2")
    context = Path("/usr/share/common-licenses/GPL-3").read_text()[:3000].rstrip() + "\n\n"
    qs = [shared_tasks.Question("cont", "", kind="choice", choices=("Each version is numbered.", "Cats purr.")),
          shared_tasks.Question("qa", "Question: Who may copy it?\nAnswer:", max_new_tokens=6)]
    c, q = write_inputs(tmp_path, [x.request() for x in qs], context)
    r = ddctl("answer", "--model", str(model), "--prompt_file", str(c), "--questions_file", str(q), timeout=600)
    assert r.returncode == 2 and "changes the tokens of the question before it" in r.stderr, r.stderr
    ctx2, qs2 = standard.stable_boundary("smollm2", context, qs)
    assert not ctx2.endswith("\n") and [ctx2 + x.text + "".join(x.choices[:1]) for x in qs2] == \
        [context + x.text + "".join(x.choices[:1]) for x in qs]
    c, q = write_inputs(tmp_path, [x.request() for x in qs2], ctx2)
    head, got = answer(model, c, q)
    assert set(got) == {"cont", "qa"} and len(got["cont"]["choice_logprobs"]) == 2
    assert standard.stable_boundary("gemma", context, qs) == (context, qs)


def test_context_ending_in_a_one_token_piece(tmp_path):
    """A context whose last prefill piece is one token (here: chunks of shared - 1; in the
    standard run: one token past a restored prefix) prefills it as a prompt row: the questions'
    prefill follows (a lone row used to count as a decode row, after which it failed with
    "prefill rows after decode rows") and the answers equal those of a run with whole chunks."""
    model = real_model()
    c, q = write_inputs(tmp_path, QUESTIONS[:2])
    flags = ["--mode", "sparse", "--budget", "256"]
    head, want = answer(model, c, q, *flags)
    n = head["shared_tokens"]
    head2, got = answer(model, c, q, *flags, "--prefill_chunk", str(n - 1))
    assert head2["shared_tokens"] == n
    for k in want:
        assert got[k]["tokens"] == want[k]["tokens"] and got[k].get("choice_logprobs") == want[k].get("choice_logprobs")
