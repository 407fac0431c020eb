"""Prefix caching with `ddctl serve`'s defaults (the default model, `full` mode, the in-process
store): the same long prompt sent twice is restored, not prefilled, the second time, with the
same text; `--prefix_block 0` turns it off."""
import json
from pathlib import Path

import pytest

from serving import Proc, ddctl_json, require_model, secret_file

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


def test_one_tenants_prompts_do_not_evict_anothers_cached_prefix(tmp_path):
    """With two API tenants each holds half of --prefix_cache and evicts only its own prefixes:
    B's flood of distinct prompts leaves A's cached prefix in place (one LRU for all evicted
    it at B's second prompt, and B could time when A had sent one)."""
    text = GPL.read_text()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "a", "key": "a" * 40}, {"tenant": "b", "key": "b" * 40}]))
    keys.chmod(0o600)
    key_a, key_b = secret_file(tmp_path, "a" * 40), secret_file(tmp_path, "b" * 40)
    # About 1000 tokens each (~37 MB of Gemma KV): a tenant's 50 MiB share holds one.
    prompts = [tmp_path / f"p{i}.txt" for i in range(4)]
    for i, p in enumerate(prompts):
        p.write_text(text[5000 * i:5000 * i + 4500] + "\n\nIn one sentence, this part")
    p = serve(tmp_path, f"--api_keys_file={keys}", "--prefix_cache=100MiB")

    def gen(prompt, key):
        return ddctl_json("generate", "--server", p.addr, "--prompt_file", str(prompt), "--max_new_tokens", "2",
                          "--raw_prompt", f"--api_key_file={key}")["usage"]
    try:
        gen(prompts[0], key_a)
        for prompt in prompts[1:]:
            gen(prompt, key_b)
        again = gen(prompts[0], key_a)
        b_again = gen(prompts[3], key_b)
        b_first = gen(prompts[1], key_b)  # B's share holds one prompt: its first went long ago
    finally:
        p.stop()
    assert int(again["prompt_tokens"]) > 900, again
    assert int(again.get("prefix_reused_tokens", 0)) >= int(again["prompt_tokens"]) - 128, again
    assert int(b_again.get("prefix_reused_tokens", 0)) >= int(b_again["prompt_tokens"]) - 128, b_again
    assert int(b_first.get("prefix_reused_tokens", 0)) == 0, b_first
