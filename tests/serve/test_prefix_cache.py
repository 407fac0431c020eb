"""Prefix caching with `ddctl serve`'s defaults (the default model, `full` mode, the in-process
store): the same long prompt sent twice is restored, not prefilled, the second time, with the
same text; `--prefix_block 0` turns it off."""
from pathlib import Path

import pytest

from serving import Proc, ddctl_json, require_model

GPL = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    # About 3000 tokens of English (the GPL's first 14000 characters).
    p = tmp_path_factory.mktemp("prefix") / "prompt.txt"
    p.write_text(GPL.read_text()[:14000] + "\n\nIn one sentence, this license")
    return p


def serve(d, *flags):
    require_model()
    return Proc("serve", ["ddctl", "serve", *flags], d)


def generate(p, prompt_file):
    return ddctl_json("generate", "--server", p.addr, "--prompt_file", str(prompt_file), "--max_new_tokens", "4",
                      "--raw_prompt")


def test_a_repeated_prompt_is_restored_at_a_tenth_of_its_first_ttft(tmp_path, prompt_file):
    p = serve(tmp_path)
    try:
        first, second = generate(p, prompt_file), generate(p, prompt_file)
    finally:
        p.stop()
    u1, u2 = first["usage"], second["usage"]
    assert int(u1["prompt_tokens"]) > 2900, u1
    assert int(u1.get("prefix_reused_tokens", 0)) == 0, u1
    # All but the last partial block of 64 tokens (and the last token) comes from the cache.
    assert int(u2["prefix_reused_tokens"]) >= int(u2["prompt_tokens"]) - 128, u2
    assert second["text"] == first["text"]
    assert u2["ttft_seconds"] <= 0.1 * u1["ttft_seconds"], (u1["ttft_seconds"], u2["ttft_seconds"])


def test_prefix_block_zero_turns_it_off(tmp_path, prompt_file):
    p = serve(tmp_path, "--prefix_block=0")
    try:
        generate(p, prompt_file)
        second = generate(p, prompt_file)
    finally:
        p.stop()
    assert int(second["usage"].get("prefix_reused_tokens", 0)) == 0, second["usage"]
