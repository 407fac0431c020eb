"""Haystacks that carry many questions each, for the standard evaluation (eval/standard.py).

A haystack is one context (instruction + license prose with statements hidden at seeded
depths) and QUESTIONS_PER_HAYSTACK questions about it. `ddctl answer` prefills the context once
per mode and budget and forks it for every question, so a question costs its own few tokens,
not a prefill. Questions over one haystack are correlated (same text, same depths); the
intervals in stats.py resample haystacks, not questions.

Families (each scored by exact match of the answer's values, or by log-likelihood):
- needle_kv: 8 magic-number needles with different keys; each question asks one key.
- qa_people: 8 people with one fact each (job, city, color or pet, several people per kind);
  each question asks one person's fact with a completion cue.
- icl_codes (not a needle): a catalogue files words of four categories (animals, colors,
  cities, jobs) under four made-up code words, shown only through scattered examples
  ("In the catalogue, the parrot is filed under code vesk."); each question asks the code of a
  word of one category that no example mentions: classification with labels defined only in
  the context.
- continuation (not a needle, log-likelihood): the context is a run of prose; each question
  adds the next few sentences and offers the true next sentence among three sentences drawn
  from elsewhere in the corpus; correct when the true one has the highest mean log-probability
  per token. Also yields the true sentence's per-token NLL (a continuous measure).
Same (seed, family, length, index) -> the same haystack and questions, byte for byte.
"""
import dataclasses
import hashlib
import random

import haystack
import scoring
import tasks
from wordlists import ADJECTIVES, ANIMALS, CITIES, COLORS, FIRST_NAMES, JOBS, LAST_NAMES, NOUNS

FAMILIES = ("needle_kv", "qa_people", "icl_codes", "state_tracking", "continuation")
NEEDLE_FAMILIES = ("needle_kv", "qa_people")
QUESTIONS_PER_HAYSTACK = 8
CONTINUATION_SENTENCES = 3   # a continuation choice is this many sentences,
CONTINUATION_WORDS = 24      # cut to this many words (~32 tokens: scoring costs a decode step per token)


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    text: str                 # follows the context; ends with the answer cue
    expected: tuple = ()      # generated answers: the values that must be there (scoring.py)
    kind: str = "candidate"   # "number", "candidate" or "choice"
    candidates: tuple = ()
    max_new_tokens: int = 0
    stop: tuple = ("\n",)
    choices: tuple = ()       # kind "choice": continuations scored by log-likelihood
    answer_index: int = 0     # kind "choice": the true one
    family: str = ""          # set by make_haystack (a haystack may carry two families)

    def request(self):
        """The line `ddctl answer --questions_file` reads."""
        r = {"id": self.id, "text": self.text}
        if self.kind == "choice":
            r["choices"] = list(self.choices)
        else:
            r["max_new_tokens"] = self.max_new_tokens
            r["stop"] = list(self.stop)
        return r

    def score(self, answer):
        """answer: the record ddctl printed. True/False."""
        if self.kind == "choice":
            per_token = [lp / max(1, n) for lp, n in zip(answer["choice_logprobs"], answer["choice_tokens"])]
            return max(range(len(per_token)), key=lambda i: (per_token[i], -i)) == self.answer_index
        return scoring.is_correct(answer["text"], self.expected, self.kind, self.candidates)


@dataclasses.dataclass(frozen=True)
class Haystack:
    id: str
    family: str
    length: int
    index: int
    seed: int
    context: str
    context_tokens: int
    questions: tuple

    def sha(self):
        h = hashlib.sha256(self.context.encode())
        for q in self.questions:
            h.update(repr(q.request()).encode())
        return h.hexdigest()[:16]


@dataclasses.dataclass
class _Spec:
    header: str
    inserts: list              # (depth, statement)
    questions: list            # Question without id (filled in later)
    word_list: object = None   # n -> the haystack as n list lines instead of prose


_NEEDLE_HEADER = ("Some special magic numbers are hidden in the text below. Remember them: questions "
                  "about them follow the text.\n\n")


def needle_kv(rng, units, start, n_questions):
    keys = tasks._distinct(rng, lambda r: f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}", n_questions)
    values = tasks._distinct(rng, tasks._number, n_questions)
    qs = [Question("", f"Question: What is the special magic number for {k} mentioned in the text above?\n"
                       f"Answer: The special magic number for {k} is", (v,), "number", max_new_tokens=16)
          for k, v in zip(keys, values)]
    return _Spec(_NEEDLE_HEADER, [(rng.random(), tasks._needle(k, v)) for k, v in zip(keys, values)], qs)


def qa_people(rng, units, start, n_questions):
    names = [f"{a} {b}" for a, b in zip(rng.sample(FIRST_NAMES, n_questions), rng.sample(LAST_NAMES, n_questions))]
    inserts, qs = [], []
    for name in names:
        statement, question, cue, pool = rng.choice(tasks._QA_FACTS)
        value = rng.choice(pool)
        inserts.append((rng.random(), statement.format(name=name, value=value)))
        qs.append(Question("", f"Question: {question.format(name=name)}\nAnswer: {cue.format(name=name)}",
                           (value,), "candidate", tuple(pool), max_new_tokens=12))
    return _Spec("Read the text below; it states some facts about people. Questions follow the text.\n\n",
                 inserts, qs)


_ICL_CATEGORIES = (("animal", ANIMALS), ("color", COLORS), ("city", CITIES), ("job", JOBS))


def _code_word(rng):
    return "".join(rng.choice(c) for c in ("bdfgklmnprstvz", "aeiou", "bdfgklmnprstvz", "aeiou", "kmnrstx"))


def icl_codes(rng, units, start, n_questions):
    """A catalogue listing (the haystack is the list itself): every word of the four categories
    but the held-out ones, each with its category's code, in seeded order, repeated to length."""
    codes = tasks._distinct(rng, _code_word, len(_ICL_CATEGORIES))
    per_cat = -(-n_questions // len(_ICL_CATEGORIES))
    examples, held = [], []
    for (_, words), code in zip(_ICL_CATEGORIES, codes):
        picked = rng.sample(words, len(words))
        held.append([(w, code) for w in picked[:per_cat]])
        examples += [(w, code) for w in picked[per_cat:]]
    order_seed = rng.random()

    def listing(n):
        out, r = [], random.Random(order_seed)
        while len(out) < n:
            batch = examples[:]
            r.shuffle(batch)
            out += batch
        return "\n".join(f"{w}: {c}" for w, c in out[:n])

    # Questions cycle through the categories so that any prefix of them is balanced.
    ordered = [held[i % len(held)][i // len(held)] for i in range(n_questions)]
    qs = [Question("", f"{w}:", (c,), "candidate", tuple(codes), max_new_tokens=6) for w, c in ordered]
    return _Spec("Catalogue codes. Every entry is a word followed by the code of its kind; all animals share "
                 "one code, all colors another, all cities another and all jobs another.\n\n", [], qs, listing)


_OBJECTS = ("lamp", "door", "kite", "vase", "chair", "boat", "bike", "mug", "scarf", "tent", "sofa", "car")


def state_tracking(rng, units, start, n_questions, updates=3):
    """Objects repainted several times, the updates scattered through the prose in order; each
    question asks an object's color after all updates (the last one, not any one)."""
    objs = rng.sample(_OBJECTS, n_questions)
    inserts, qs = [], []
    for o in objs:
        colors = tasks._distinct(rng, lambda r: r.choice(COLORS), updates)
        depths = sorted(rng.random() for _ in colors)
        inserts += [(d, f"The {o} was painted {c}.") for d, c in zip(depths, colors)]
        qs.append(Question("", f"Question: The {o} was painted several times. What color is the {o} after the "
                               f"last painting?\nAnswer: After the last painting the {o} is", (colors[-1],),
                           "candidate", tuple(COLORS), max_new_tokens=8))
    return _Spec("Some objects are painted in the text below, some more than once. Questions follow the text.\n\n",
                 inserts, qs)


def _run(units, at, n, max_words=CONTINUATION_WORDS):
    words = " ".join(units[(at + i) % len(units)][0] for i in range(n)).split()
    return " ".join(words[:max_words])


def continuation_questions(rng, units, after, n_questions, context="", n_distractors=1, run=CONTINUATION_SENTENCES):
    """Questions over a context that ends at unit `after`: question j adds j sentences, then
    offers the next `run` sentences and `n_distractors` runs of `run` sentences from elsewhere.

    A distractor never starts with text the context or the leads contain: a run the model has
    already seen would be copied (induction), which at 32K (two thirds of the corpus in the
    context) made full attention pick the distractor three times in four."""
    qs = []
    leads = " ".join(units[(after + i) % len(units)][0] for i in range(n_questions + run))
    for j in range(n_questions):
        lead = [units[(after + i) % len(units)][0] for i in range(j)]
        truth = _run(units, after + j, run)
        distractors = []
        for _ in range(100_000):
            if len(distractors) == n_distractors:
                break
            cand = _run(units, rng.randrange(len(units)), run)
            head = cand[:48]
            if cand != truth and cand not in distractors and head not in context and head not in leads:
                distractors.append(cand)
        else:
            raise ValueError("no continuation distractor outside the context: the corpus is too small for this length")
        choices = [truth] + distractors
        rng.shuffle(choices)
        text = " ".join(lead)
        qs.append(Question("", text, kind="choice", choices=tuple(choices), family="continuation",
                           answer_index=choices.index(truth)))
    return qs


def _continuation(seed, units, start, n, n_questions, header="", inserts=()):
    """The context (`header`, then n sentences from `start` with `inserts` as their own
    paragraphs) and its continuation questions."""
    context = header + tasks.render_prose(units, start, n, list(inserts)).rstrip("\n")
    # The prose runs on: the questions continue the last paragraph (or start the next one).
    if units[(start + n - 1) % len(units)][1]:
        context += "\n\n"
    qs = []
    for q in continuation_questions(random.Random(seed), units, start + n, n_questions, context):
        text = q.text if context.endswith("\n") else (" " + q.text if q.text else "")
        glue = "" if (not text and context.endswith("\n")) else " "
        qs.append(dataclasses.replace(q, text=text, choices=tuple(glue + c for c in q.choices)))
    return context, qs


BUILDERS = {"needle_kv": needle_kv, "qa_people": qa_people, "icl_codes": icl_codes, "state_tracking": state_tracking}


def _prompt_tokens(count_tokens, context, q):
    """Tokens of the longest prompt this question makes (with its answer or longest choice)."""
    return count_tokens(context + q.text + max(q.choices, key=len, default="")) + q.max_new_tokens


def make_haystack(family, length, index, seed, count_tokens, paragraphs, n_questions=QUESTIONS_PER_HAYSTACK):
    """One haystack for `family`, or for several joined by "+" that share it: "continuation"
    with a prose family ("qa_people+continuation") puts the facts into the prose it continues,
    so one prefill serves both (n_questions of each). Every question records its family."""
    fams = family.split("+")
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown or len(set(fams)) != len(fams) or (len(fams) > 1 and ("continuation" not in fams or len(fams) > 2)):
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)} (or X+continuation)")
    rng = random.Random(f"{seed}/{family}/{length}/{index}/shared")
    units = tasks.split_sentences(paragraphs)
    start = rng.randrange(len(units))
    hid = f"{family}/{length}/{index}/s{seed}"
    others = [f for f in fams if f != "continuation"]
    s = BUILDERS[others[0]](rng, units, start, n_questions) if others else None
    if s is not None:
        s.questions = [dataclasses.replace(q, family=others[0]) for q in s.questions]
    if "continuation" in fams:
        if s is not None and s.word_list:
            raise ValueError(f"{others[0]} has no prose to continue")
        header, inserts = (s.header, s.inserts) if s else ("", [])
        cont_seed = rng.random()
        # Sized with a stand-in question (the lead sentences plus a choice), then shrunk while
        # the context plus its longest question does not fit.
        spec = tasks.Spec(header, _run(units, start, n_questions + CONTINUATION_SENTENCES, 10_000), (), "choice", 0,
                          inserts=inserts)
        _, _, n = tasks.fit_prompt(spec, length, count_tokens, units, start)
        for _ in range(20):
            context, qs = _continuation(cont_seed, units, start, n, n_questions, header, inserts)
            qs = [dataclasses.replace(q, family="continuation") for q in qs]
            if s is not None:   # the prose runs on: a question starts its own paragraph
                sep = "" if context.endswith("\n") else "\n\n"
                qs = [dataclasses.replace(q, text=sep + q.text) for q in s.questions] + qs
            over = max(_prompt_tokens(count_tokens, context, q) for q in qs) - length
            if over <= 0:
                break
            n -= max(1, over // 20)
    else:
        longest = max(s.questions, key=lambda q: len(q.text))
        spec = tasks.Spec(s.header, longest.text, (), longest.kind, longest.max_new_tokens, inserts=s.inserts,
                          word_list=s.word_list)
        _, _, n = tasks.fit_prompt(spec, length - longest.max_new_tokens, count_tokens, units, start)
        body = s.word_list(n) + "\n" if s.word_list else tasks.render_prose(units, start, n, s.inserts)
        context = s.header + body
        qs = s.questions
    qs = tuple(dataclasses.replace(q, id=f"{hid}/q{j}") for j, q in enumerate(qs))
    return Haystack(id=hid, family=family, length=length, index=index, seed=seed, context=context,
                    context_tokens=count_tokens(context), questions=qs)


def generate(families, lengths, haystacks, seed, count_tokens, paragraphs=None):
    """Haystacks for every family x length x index, in that order."""
    paragraphs = paragraphs if paragraphs is not None else haystack.load_paragraphs()
    return [make_haystack(f, n, i, seed, count_tokens, paragraphs)
            for n in lengths for f in families for i in range(haystacks)]
