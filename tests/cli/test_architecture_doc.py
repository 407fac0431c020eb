"""docs/architecture.md's "How to change" sections name files and symbols a newcomer will open:
every path and every C++ name in backticks there must exist in the tree."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("## How to change the chunk selection", "## How to add a fetch strategy")
SOURCE_DIRS = ("decode-worker", "kernels", "kv-pool", "common")


def section(text, title):
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def sources():
    files = []
    for d in SOURCE_DIRS:
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".h", ".cc", ".cu")]
    return {p: p.read_text(errors="replace") for p in files}


def resolve_path(token):
    """A path from the root, or a bare file name that must exist under decode-worker/engine."""
    if "/" in token:
        return (ROOT / token).exists()
    return (ROOT / "decode-worker" / "engine" / token).exists()


def defined(name, member, texts):
    """`name` is a word of some source; with `member`, one source holds both."""
    word = re.compile(r"\b%s\b" % re.escape(name))
    member_re = re.compile(r"\b%s\b" % re.escape(member)) if member else None
    return any(word.search(t) and (member_re is None or member_re.search(t)) for t in texts.values())


def test_how_to_sections_name_files_and_symbols_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    texts = sources()
    checked, missing = 0, []
    for title in SECTIONS:
        for token in re.findall(r"`([^`]+)`", section(text, title)):
            if re.fullmatch(r"[\w./-]+\.(h|cc|cu|txt|md)", token):
                checked += 1
                if not resolve_path(token):
                    missing.append(token)
            elif re.fullmatch(r"[A-Z]\w*(::\w+)?", token) and "..." not in token:
                checked += 1
                name, _, member = token.partition("::")
                if not defined(name, member or None, texts):
                    missing.append(token)
    assert checked >= 20, f"only {checked} names found: the sections moved or were renamed"
    assert not missing, f"docs/architecture.md names what the tree lacks: {missing}"


def test_the_check_catches_a_name_that_does_not_exist():
    texts = sources()
    assert defined("ChunkSelector", "ScoreOwn", texts)
    assert not defined("ChunkSelector", "NoSuchMethodAnywhere", texts)
    assert not resolve_path("decode-worker/engine/no_such_file.cc")
