"""Exact-match scoring of a generated answer against a task's expected values.

An answer is normalized (lowercase; every character that is not a letter or digit becomes a
space; whitespace collapsed) and split into items. The answer's *values* are the items that
could be an answer to the task:
  - kind "number": every item of 5 or more digits (so a wrong or invented number counts);
  - kind "candidate": every item that is one of the task's candidates (all needle keys' values,
    variable names, list words or cities that the prompt contains).
The answer is correct when its set of values equals the expected set exactly: nothing missing
(a multi-value answer needs every value) and nothing extra (naming a distractor is wrong).
Order and repetition do not matter; surrounding words ("The number is 1234567.") do not either.
"""
import re

_NOT_ALNUM = re.compile(r"[^0-9a-z]+")
_NUMBER = re.compile(r"^\d{5,}$")


def normalize(text):
    return " ".join(_NOT_ALNUM.sub(" ", text.lower()).split())


def answer_values(answer, kind, candidates=()):
    items = normalize(answer).split()
    if kind == "number":
        return {i for i in items if _NUMBER.match(i)}
    if kind == "candidate":
        pool = {normalize(c) for c in candidates}
        return {i for i in items if i in pool}
    raise ValueError(f"unknown answer kind {kind!r}")


def is_correct(answer, expected, kind, candidates=()):
    """True when the answer names exactly the expected values (see the module docstring)."""
    return answer_values(answer, kind, candidates) == {normalize(e) for e in expected}
