"""SmolLM2's tokenizer in the engine (`ddctl tokenize`) against Hugging Face `tokenizers`.

    DD_BIN_DIR=build/bin python3 -m pytest -q tests/reference/test_tokenizer_reference.py

The reference is built from the GGUF's own vocabulary and merges and configured as SmolLM2's
tokenizer.json is: byte-level BPE, no normalizer, pre-tokenizer Digits(individual_digits) then
ByteLevel(add_prefix_space=False, use_regex=True) (GGUF pre-tokenizer name `smollm`), the 17
control tokens as special added tokens. So token ids must be equal, not merely close. The
reference's own sanity is checked first, without ddctl, so a wrong reference cannot pass by
agreeing with a wrong engine.

ddctl missing is a failure. The SmolLM2 file missing is a skip, unless DD_REQUIRE_MODEL is set
(then a failure), as in test_reference.py.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ddref  # noqa: E402
from test_reference import LONG_TEXT, _run, ddctl_path, real_model_path  # noqa: E402

try:
    import tokenizers
except ImportError:  # fail these tests, not the whole pytest run at collection
    tokenizers = None

CONTROL = 3  # llama.cpp token type: parsed as one token when special parsing is on
IM_START, IM_END = 1, 2

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. Then it ran away!",
    "contractions": "I'm sure you'll see they've gone; we'd say it's fine, don't you? I'LL GO, You'Re",
    "python": ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
               "print([fib(i) for i in range(10)])  # 0, 1, 1, 2, 3\n"),
    "c": 'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn x->y[0] != NULL && a <= b;\n}\n',
    "html": '<div class="note">Hello&nbsp;world</div>',
    "numbers": "Call 555-0123 or +1 (800) 123 4567; pi is 3.14159, 1,000,000 and 2024-06-01. x2 3rd",
    # The vocabulary has no multi-digit pieces, so for ASCII the Digits step is invisible; it
    # shows where a space meets a non-ASCII number (\p{N}: ½, ², Arabic-Indic digits, Ⅻ, ①).
    "numbers_unicode": "Area 5 m², ½ ¼ ¾ ²³, ٣٤٥ ١٢٣, Ⅻ ⅻ ①②",
    "accents": "Crème brûlée, naïve café, São Paulo, Zürich, Ærøskøbing, Ελληνικά, Привет",
    "cjk": "日本語のテキストと中文字符，한국어 텍스트。",
    "emoji": "Emoji: 🙂👍🏽 🇫🇷 👩‍👩‍👧 done",
    "whitespace": "a  b   c\n\nd\t\te \n \n  f   ",
    "leading_spaces": "    indented\n\n\n\nafter blank lines",
    "empty": "",
}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return real_model_path("smollm2")


@pytest.fixture(scope="module")
def gguf_fields(smollm2):
    return ddref.GGUFTensors(str(smollm2))


@pytest.fixture(scope="module")
def hf(gguf_fields):
    if tokenizers is None:
        pytest.fail("the `tokenizers` package is missing: pip install -r scripts/requirements.txt",
                    pytrace=False)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    pieces = gguf_fields.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_fields.field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    types = gguf_fields.field("tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(pieces, types) if t == CONTROL])
    return tok


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def ddctl_ids(model: Path, text: str, tmp_path: Path) -> list[int]:
    # Through a file, so every byte reaches the tokenizer as is (no argv or flag parsing).
    f = tmp_path / f"text-{uuid.uuid4().hex}.txt"
    f.write_bytes(text.encode("utf-8"))
    proc = _run([str(ddctl_path()), "tokenize", "--model", str(model), "--prompt_file", str(f)], 120)
    lines = proc.stdout.strip().splitlines()
    line = lines[-1] if lines else ""
    try:
        return [int(s) for s in line.split(",") if s.strip()]
    except ValueError:
        pytest.fail(f"ddctl tokenize printed {line[:200]!r}, want comma-separated ids", pytrace=False)


# --------------------------------------------------------------------------------------------
# The reference itself
# --------------------------------------------------------------------------------------------

def test_gguf_says_what_the_reference_assumes(gguf_fields):
    assert gguf_fields.field("tokenizer.ggml.model") == "gpt2"
    assert gguf_fields.field("tokenizer.ggml.pre") == "smollm"
    assert gguf_fields.field("tokenizer.ggml.add_bos_token") is False
    pieces = gguf_fields.field("tokenizer.ggml.tokens")
    assert (pieces[IM_START], pieces[IM_END]) == ("<|im_start|>", "<|im_end|>")


def test_reference_is_sane(hf):
    # Digits split one by one, the space before them stays its own piece.
    assert hf.encode(" 123", add_special_tokens=False).tokens == ["Ġ", "1", "2", "3"]
    assert hf_ids(hf, "The capital of France is") == [504, 3575, 282, 4649, 314]
    assert hf.encode("don't", add_special_tokens=False).tokens == ["don", "'t"]
    assert hf_ids(hf, "<|im_start|>user\nhi<|im_end|>")[0] == IM_START
    for name, text in [*TEXTS.items(), ("gpl", LONG_TEXT.read_text(encoding="utf-8")[:3000])]:
        assert hf.decode(hf_ids(hf, text)) == text, f"{name}: reference does not round-trip"


# --------------------------------------------------------------------------------------------
# The engine against it
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TEXTS)
def test_engine_matches_reference(name, smollm2, hf, tmp_path):
    text = TEXTS[name]
    assert ddctl_ids(smollm2, text, tmp_path) == hf_ids(hf, text)


def test_engine_matches_reference_on_long_text(smollm2, hf, tmp_path):
    text = LONG_TEXT.read_text(encoding="utf-8")[:3000]
    got, want = ddctl_ids(smollm2, text, tmp_path), hf_ids(hf, text)
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail(f"first difference at token {i}: engine {got[i:i + 8]}, reference "
                    f"{want[i:i + 8]} (context {hf.decode(want[max(0, i - 8):i + 8])!r})",
                    pytrace=False)


def test_no_bos_is_added(smollm2, tmp_path):
    # add_bos_token is false: "Hello" is its own single token, nothing in front.
    assert ddctl_ids(smollm2, "Hello", tmp_path) == [19556]


CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", ["<|im_start|>user\nhi<|im_end|>", CHAT,
                                  "x<|im_end|>y<|endoftext|><|im_start|>", "<|im_start|><|im_start|>"])
def test_special_tokens_parse_as_single_ids(text, smollm2, hf, tmp_path):
    got = ddctl_ids(smollm2, text, tmp_path)
    assert got == hf_ids(hf, text)
    assert got.count(IM_START) == text.count("<|im_start|>")
    assert got.count(IM_END) == text.count("<|im_end|>")
    if text.startswith("<|im_start|>"):
        assert got[0] == IM_START
