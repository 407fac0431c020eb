"""Seeded long-context tasks: a family builds the content, fit_prompt sizes it to a token target.

A family returns a Spec: text before the haystack, statements to hide in it at given depths,
the question with its answer cue, and the expected values. The haystack is license prose
(haystack.py) or, for common_words, a word list. fit_prompt grows or shrinks the haystack until
the prompt measures at most `length` tokens with the real tokenizer (BOS included) and comes
within 1% of it (or one more sentence would not fit).
Same (seed, family, length, index) -> same task, byte for byte.
"""
import dataclasses
import hashlib
import random
import re

import haystack
import scoring
from wordlists import ADJECTIVES, ANIMALS, CITIES, COLORS, FIRST_NAMES, JOBS, LAST_NAMES, NOUNS

FAMILIES = ("needle_single", "needle_multikey", "needle_multivalue", "needle_multiquery",
            "variable_tracking", "common_words", "qa")


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    family: str
    length: int            # target: the prompt has at most this many tokens
    index: int
    seed: int
    prompt: str
    prompt_tokens: int     # measured with the tokenizer the task was fitted with
    expected: tuple        # the answer's values must be exactly these (scoring.py)
    kind: str              # "number" or "candidate"
    candidates: tuple      # values that count as an answer's values when kind is "candidate"
    max_new_tokens: int
    stop: str

    def score(self, answer):
        return scoring.is_correct(answer, self.expected, self.kind, self.candidates)

    def prompt_sha(self):
        return hashlib.sha256(self.prompt.encode()).hexdigest()[:16]


@dataclasses.dataclass
class Spec:
    header: str
    question: str          # after the haystack; ends with the answer cue
    expected: tuple
    kind: str
    max_new_tokens: int
    candidates: tuple = ()
    inserts: list = dataclasses.field(default_factory=list)  # (depth in [0, 1], statement)
    word_list: object = None   # common_words: n -> list text, replaces the prose haystack
    stop: str = "\n"          # ddctl --stop (comma-separated): where the answer ends


def _key(rng):
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _distinct(rng, make, n):
    out = []
    while len(out) < n:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _number(rng):
    return str(rng.randrange(1_000_000, 10_000_000))


_NEEDLE_HEADER = ("Some special magic numbers are hidden in the text below. Remember them: a question "
                  "about them follows the text.\n\n")


def _needle(key, value):
    return f"The special magic number for {key} is: {value}."


def needle_single(rng, _vocab):
    key, value = _key(rng), _number(rng)
    return Spec(_NEEDLE_HEADER,
                f"Question: What is the special magic number for {key} mentioned in the text above?\n"
                f"Answer: The special magic number for {key} is", (value,), "number", 16,
                inserts=[(rng.random(), _needle(key, value))])


def needle_multikey(rng, _vocab):
    keys, values = _distinct(rng, _key, 4), _distinct(rng, _number, 4)
    return Spec(_NEEDLE_HEADER,
                f"Question: What is the special magic number for {keys[0]} mentioned in the text above?\n"
                f"Answer: The special magic number for {keys[0]} is", (values[0],), "number", 16,
                inserts=[(rng.random(), _needle(k, v)) for k, v in zip(keys, values)])


def needle_multivalue(rng, _vocab):
    key, values = _key(rng), _distinct(rng, _number, 3)
    # The question says how many: without the count this model lists the first value and then
    # counts upwards from it until max_new_tokens.
    return Spec(_NEEDLE_HEADER,
                f"Question: The text above mentions three special magic numbers for {key}. What are they?\n"
                f"Answer: The three special magic numbers for {key} are", tuple(values), "number", 40,
                inserts=[(rng.random(), f"One of the special magic numbers for {key} is: {v}.") for v in values])


def needle_multiquery(rng, _vocab):
    keys, values = _distinct(rng, _key, 4), _distinct(rng, _number, 4)
    a, b = keys[0], keys[1]
    return Spec(_NEEDLE_HEADER,
                f"Question: What are the special magic numbers for {a} and {b} mentioned in the text above?\n"
                f"Answer: The special magic numbers for {a} and {b} are", (values[0], values[1]), "number", 32,
                inserts=[(rng.random(), _needle(k, v)) for k, v in zip(keys, values)])


def _var_name(rng):
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def variable_tracking(rng, _vocab):
    names = _distinct(rng, _var_name, 6)
    chain, other = names[:3], names[3:]   # two chains of three variables; the question follows one
    value, other_value = _distinct(rng, lambda r: str(r.randrange(10_000, 100_000)), 2)

    def assignments(chain_names, chain_value):
        return [f"VAR {chain_names[0]} = {chain_value}."] + [
            f"VAR {chain_names[i]} = VAR {chain_names[i - 1]}." for i in range(1, len(chain_names))]

    depths = sorted(rng.random() for _ in chain)   # each chain appears in assignment order
    other_depths = sorted(rng.random() for _ in other)
    # The cue ends in "VAR" so the answer starts on the cue's line (after "are:" this model
    # starts a new line, which the stop string would cut).
    return Spec("Memorize the variable assignments hidden in the text below; a question about them "
                "follows the text.\n\n",
                f"Question: The value {value} is assigned to three variables in the text above, directly or "
                f"through another variable. Which three variables are they?\n"
                f"Answer: The three variables assigned the value {value} are: VAR", tuple(chain), "candidate", 40,
                candidates=tuple(names),
                inserts=list(zip(depths, assignments(chain, value))) + list(zip(other_depths, assignments(other, other_value))))


_CW_HEADER = "Here is a list of words. Three of the words appear much more often than the others.\n\n"
_CW_QUESTION = ("Question: Which three words appear most often in the list above?\n"
                "Answer: The three words that appear most often in the list above are:\n1.")


def common_words(rng, vocab):
    cue = set(scoring.normalize(_CW_HEADER + _CW_QUESTION).split())
    words = [w for w in vocab if w not in cue]   # an answer's own wording never counts as a value
    rng.shuffle(words)
    common, rare = words[:3], words[3:]
    shuffle_seed = rng.random()

    def word_list(n):
        # Each common word fills 1/8 of the list (at least 8 times); the other words share the
        # rest about equally (twice each while the vocabulary lasts, more often at 32K).
        per_common = max(8, n // 8)
        slots = max(0, n - 3 * per_common)
        distinct = max(1, min(len(rare), slots // 2))
        items = [w for w in common for _ in range(per_common)] + [rare[i % distinct] for i in range(slots)]
        random.Random(f"{shuffle_seed}/{n}").shuffle(items)
        return ", ".join(items) + "."

    # The answer is a numbered list ("1." is in the cue); it ends before a fourth item.
    return Spec(_CW_HEADER, _CW_QUESTION, tuple(common), "candidate", 24, candidates=tuple(words),
                word_list=word_list, stop="\n4.,\n\n")


_QA_FACTS = (  # (statement, question, answer cue, possible answers)
    ("{name} was born in {value}.", "In which city was {name} born?", "{name} was born in", CITIES),
    ("{name} works as a {value}.", "What is the job of {name}?", "{name} works as a", JOBS),
    ("The favorite color of {name} is {value}.", "What is the favorite color of {name}?",
     "The favorite color of {name} is", COLORS),
    ("{name} has a pet {value}.", "What kind of pet does {name} have?", "{name} has a pet", ANIMALS),
)


def qa(rng, _vocab):
    """Four facts about four people: the asked kind twice (target and a distractor), two others."""
    names = [f"{a} {b}" for a, b in zip(rng.sample(FIRST_NAMES, 4), rng.sample(LAST_NAMES, 4))]
    kinds = rng.sample(_QA_FACTS, 3)
    kinds = [kinds[0]] + kinds
    values = _distinct(rng, lambda r: r.choice(kinds[0][3]), 2) + [rng.choice(k[3]) for k in kinds[2:]]
    facts = [k[0].format(name=n, value=v) for k, n, v in zip(kinds, names, values)]
    _, question, cue, pool = kinds[0]
    return Spec("Read the text below; it states some facts about people. A question follows the text.\n\n",
                f"Question: {question.format(name=names[0])}\nAnswer: {cue.format(name=names[0])}",
                (values[0],), "candidate", 12, candidates=tuple(pool),
                inserts=[(rng.random(), f) for f in facts])


BUILDERS = {f: globals()[f] for f in FAMILIES}


def split_sentences(paragraphs):
    """Haystack units: (sentence, ends_paragraph), in order."""
    units = []
    for p in paragraphs:
        parts = [s for s in re.split(r"(?<=[.;:!?])\s+", p) if s]
        units += [(s, i == len(parts) - 1) for i, s in enumerate(parts)]
    return units


def render_prose(units, start, n, inserts):
    """n haystack sentences from `start` (cyclically), statements as their own paragraphs."""
    if n > len(units):
        raise ValueError(f"haystack has {len(units)} sentences, {n} requested")
    at = {}
    for depth, text in inserts:
        at.setdefault(min(n, round(depth * n)), []).append(text)
    out = []
    for i in range(n + 1):
        for text in at.get(i, []):
            if out and not out[-1].endswith("\n\n"):
                out[-1] = out[-1].rstrip() + "\n\n"   # the statement starts its own paragraph
            out.append(text + "\n\n")
        if i < n:
            sentence, ends = units[(start + i) % len(units)]
            out.append(sentence + ("\n\n" if ends else " "))
    return "".join(out).rstrip() + "\n\n"


def render_prompt(spec, units, start, n):
    """The prompt with n haystack units (sentences, or words of a word list)."""
    body = spec.word_list(n) + "\n\n" if spec.word_list else render_prose(units, start, n, spec.inserts)
    return spec.header + body + spec.question


def fit_prompt(spec, length, count_tokens, units, start):
    """A haystack whose prompt has <= length tokens; returns (prompt, tokens, units used).

    Stops as soon as the prompt is within 1% of the target; otherwise takes the largest number
    of whole sentences that fits (so it can end up one long sentence short of the target).
    """
    fixed = count_tokens(render_prompt(spec, units, start, 0))
    if fixed > length:
        raise ValueError(f"length {length} is below the task's fixed text ({fixed} tokens)")
    max_n = len(units) if not spec.word_list else 1_000_000
    slack = max(8, length // 100)
    lo, lo_tokens, hi = 0, fixed, max_n + 1   # lo fits; hi does not (or is out of range)
    n = min(max_n, max(1, (length - fixed) // 25))
    for _ in range(40):
        tokens = count_tokens(render_prompt(spec, units, start, n))
        if tokens <= length:
            lo, lo_tokens = n, tokens
            if length - tokens <= slack or n == max_n:
                break
        else:
            hi = n
        if hi - lo <= 1:
            break
        per_unit = max(1e-3, (tokens - fixed) / n)
        guess = int(lo + (length - slack / 2 - lo_tokens) / per_unit)
        n = min(hi - 1, max(lo + 1, guess))
    if lo == max_n and length - lo_tokens > slack and not spec.word_list:
        raise ValueError(f"haystack too short: all {max_n} sentences give {lo_tokens} tokens, target {length}")
    return render_prompt(spec, units, start, lo), lo_tokens, lo


def make_task(family, length, index, seed, count_tokens, paragraphs):
    if family not in BUILDERS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"{seed}/{family}/{length}/{index}")
    spec = BUILDERS[family](rng, haystack.vocabulary(paragraphs))
    units = split_sentences(paragraphs)
    prompt, tokens, _ = fit_prompt(spec, length, count_tokens, units, rng.randrange(len(units)))
    return Task(id=f"{family}/{length}/{index}/s{seed}", family=family, length=length, index=index, seed=seed,
                prompt=prompt, prompt_tokens=tokens, expected=tuple(spec.expected), kind=spec.kind,
                candidates=tuple(spec.candidates), max_new_tokens=spec.max_new_tokens,
                stop=spec.stop)


def generate(families, lengths, per_family, seed, count_tokens, paragraphs=None):
    """Tasks for every family x length x index in that order (paragraphs default: haystack.py)."""
    paragraphs = paragraphs if paragraphs is not None else haystack.load_paragraphs()
    return [make_task(f, n, i, seed, count_tokens, paragraphs)
            for f in families for n in lengths for i in range(per_family)]
