"""Haystack text for the long-context tasks: natural English that every Debian machine has.

The source is the license texts of /usr/share/common-licenses (package base-files, Essential:
yes), read in the fixed order of HAYSTACK_FILES. The symlinks there (GPL, LGPL, GFDL) point at
files already in the list and are not read twice. Together ~237 KB, ~50K Gemma tokens, which
covers a 32K-token prompt without repeating a paragraph.
"""
import os
import re

LICENSE_DIR = "/usr/share/common-licenses"
HAYSTACK_FILES = (
    "GPL-3", "GFDL-1.3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GPL-2", "Artistic", "CC0-1.0",
    "MPL-1.1", "LGPL-2", "GFDL-1.2", "GPL-1", "LGPL-3", "BSD",
)


# The license texts whole, for natural-text prompts (predictors, fidelity, benchmarks).
def license_path(name):
    return os.path.join(LICENSE_DIR, name)


NATURAL_TEXTS = tuple(license_path(n) for n in ("GPL-3", "GFDL-1.3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GPL-2"))


class HaystackMissing(Exception):
    """A haystack source file is absent or unreadable."""


def load_paragraphs(directory=LICENSE_DIR, files=HAYSTACK_FILES):
    """Returns the sources' paragraphs, each reflowed onto one line, in file order.

    Paragraphs are separated by blank lines in the sources; hard line breaks inside a
    paragraph become spaces, so the model sees prose rather than a 70-column layout.
    """
    paragraphs = []
    for name in files:
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise HaystackMissing(
                f"haystack source {path} is missing or unreadable ({e.strerror}); it comes with Debian's "
                f"base-files package (apt-get install --reinstall base-files)") from e
        for block in re.split(r"\n\s*\n", text):
            # Asterisks that frame boxed text (MPL-1.1) are dropped with the line breaks.
            line = " ".join(w for w in block.split() if w.strip("*"))
            # Separator lines ("-----", "* * *") carry no prose.
            if len(re.findall(r"[A-Za-z]", line)) >= 20:
                paragraphs.append(line)
    if not paragraphs:
        raise HaystackMissing(f"no text found in the haystack sources under {directory}")
    return paragraphs


def vocabulary(paragraphs, min_len=4):
    """Distinct lowercase alphabetic words of the haystack, sorted, minus common function words.

    Used by common_words for its word lists, so they are English words the tokenizer knows.
    """
    words = set()
    for p in paragraphs:
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", p) if len(w) >= min_len)
    return sorted(words - _FUNCTION_WORDS)


_FUNCTION_WORDS = frozenset("""
    that this with from have will shall been were what when which where while their there these
    those they them then than into onto also such your yours other only some same each more most
    must does made make upon under over about after before being both either neither very would
    could should here hereby herein thereof whether unless until within without against among
    through between because
""".split())
