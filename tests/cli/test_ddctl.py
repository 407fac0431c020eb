"""Bad input through the user's entry point (`ddctl`): each case must exit non-zero with a
message that names the problem — never a crash, a hang or wrong output.

Uses the tiny synthetic models of tests/reference (written into a temp dir), so no download.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))
import make_synthetic  # noqa: E402

BIN = Path(os.environ.get("DD_BIN_DIR", REPO / "build" / "bin"))


def ddctl(*args, env=None, timeout=120):
    exe = BIN / "ddctl"
    if not exe.is_file():
        pytest.fail(f"ddctl not built at {exe}", pytrace=False)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_synthetic.generate(str(out), 7)
    return out / "tiny-llama.gguf"


def test_generate_works_on_tiny_model(tiny):
    r = ddctl("generate", "--model", str(tiny), "--prompt", "hello world", "--max_new_tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    import json
    j = json.loads(r.stdout)
    assert j["prompt_tokens"] > 0
    assert (j["stop_reason"] == "max_tokens" and j["generated_tokens"] == 5) or \
        (j["stop_reason"] == "eos" and j["generated_tokens"] < 5), j


def test_info_lists_the_devices_and_whether_each_is_usable(tiny):
    import json
    r = ddctl("info", "--model", str(tiny))
    assert r.returncode == 0, r.stderr
    devices = json.loads(r.stdout)["devices"]
    assert devices["cpu"] == "usable" and devices["sim"] == "usable", devices
    # cuda: usable where a GPU answers, else the reason.
    assert devices["cuda"] == "usable" or devices["cuda"].startswith("--device cuda: "), devices
    # auto (the default) takes cuda exactly where it is usable, and says why.
    auto = json.loads(r.stdout)["device_auto"]
    if devices["cuda"] == "usable":
        assert auto.startswith("cuda (auto: CUDA device "), auto
    else:
        assert auto.startswith("cpu (auto: cuda not usable, "), auto


def test_the_default_device_is_chosen_and_printed_at_start(tiny):
    import json
    info = json.loads(ddctl("info", "--model", str(tiny)).stdout)
    r = subprocess.run([str(BIN / "ddctl"), "generate", "--model", str(tiny), "--prompt", "hi", "--max_new_tokens", "2"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"device {info['device_auto']}".encode() in r.stderr, (info["device_auto"], r.stderr)


def test_missing_default_model_names_fetch_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DD_MODEL", "DD_MODEL_DIR")}
    env["HOME"] = str(tmp_path)
    r = ddctl("generate", "--prompt", "hi", env=env)
    assert r.returncode != 0
    assert "scripts/fetch-model" in r.stderr, r.stderr


def test_missing_explicit_model_names_path(tmp_path):
    r = ddctl("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert r.returncode != 0 and "nope.gguf" in r.stderr, r.stderr


def test_truncated_model_names_tensor(tiny, tmp_path):
    data = tiny.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    r = ddctl("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode != 0
    assert "truncated.gguf" in r.stderr and "tensor '" in r.stderr, r.stderr


def test_corrupt_metadata_names_field(tiny, tmp_path):
    data = bytearray(tiny.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    data[at:at + 4] = (99).to_bytes(4, "little")  # the value's type id
    bad = tmp_path / "badfield.gguf"
    bad.write_bytes(bytes(data))
    r = ddctl("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode != 0
    assert "llama.block_count" in r.stderr, r.stderr


def test_prompt_longer_than_context(tiny, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog; " * 800)
    r = ddctl("generate", "--model", str(tiny), "--prompt_file", str(prompt), timeout=300)
    assert r.returncode != 0
    assert "context" in r.stderr and "tokens" in r.stderr, r.stderr


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "-1", "temperature"),
    ("--top_p", "0", "top_p"),
    ("--top_p", "1.5", "top_p"),
    ("--top_k", "-3", "top_k"),
    ("--max_new_tokens", "0", "max_new_tokens"),
    ("--matmul", "fp8", "matmul"),
    ("--mode", "turbo", "unknown decode mode"),
    ("--budget", "4", "smaller than one chunk"),
    ("--stop_ids", "7,x", "--stop_ids: 'x' is not a token id"),
])
def test_invalid_sampling_parameters(tiny, flag, value, needle):
    extra = ["--mode=sparse"] if flag == "--budget" else []
    r = ddctl("generate", "--model", str(tiny), "--prompt", "hi", f"{flag}={value}", *extra)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr


def test_empty_prompt_and_unknown_command(tiny):
    r = ddctl("generate", "--model", str(tiny), "--prompt", "")
    assert r.returncode != 0 and "prompt" in r.stderr
    r = ddctl("frobnicate")
    assert r.returncode != 0 and "unknown command" in r.stderr


def test_sparse_mode_with_full_budget_matches_full(tiny):
    """All layers of the tiny llama are sparse; a budget covering the context gives the
    same greedy tokens as full attention (bit-identical logits are checked in C++)."""
    args = ["generate", "--model", str(tiny), "--prompt", "the quick brown fox " * 30,
            "--max_new_tokens", "12", "--ignore_eos", "--json"]
    full = ddctl(*args)
    sparse = ddctl(*args, "--mode", "sparse", "--budget", "2048")
    assert full.returncode == 0 and sparse.returncode == 0, full.stderr + sparse.stderr
    import json
    jf, js = json.loads(full.stdout), json.loads(sparse.stdout)
    assert jf["tokens"] == js["tokens"]
    assert js["mode"] == "sparse" and js["fetched_chunks"] > 0


def test_dualdecoder_mode_matches_sparse_tokens(tiny):
    """The dual-token step changes what is fetched when, never the tokens."""
    import json
    args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 40,
            "--max_new_tokens", "10", "--ignore_eos", "--json", "--budget", "64"]
    sparse = ddctl(*args, "--mode", "sparse")
    dual = ddctl(*args, "--mode", "dualdecoder")
    assert sparse.returncode == 0 and dual.returncode == 0, sparse.stderr + dual.stderr
    js, jd = json.loads(sparse.stdout), json.loads(dual.stdout)
    assert js["tokens"] == jd["tokens"]
    assert 0.0 <= jd["hit_rate"] <= 1.0 and jd["prefetch_bytes"] > 0


def test_resident_fetch_modes_match_sparse_and_move_fewer_bytes(tiny):
    """sparse-cached and dualdecoder keep a resident set: they give sparse's tokens, report the
    fetch they use and what they reused, and fetch fewer chunks urgently than sparse's on-demand
    fetch."""
    import json
    args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 40,
            "--max_new_tokens", "10", "--ignore_eos", "--json", "--budget", "64"]
    runs = {name: ddctl(*args, *extra) for name, extra in {
        "sparse": ["--mode", "sparse"], "cached": ["--mode", "sparse-cached"],
        "dual": ["--mode", "dualdecoder"]}.items()}
    for name, r in runs.items():
        assert r.returncode == 0, name + r.stderr
    j = {name: json.loads(r.stdout) for name, r in runs.items()}
    assert all(j[n]["tokens"] == j["sparse"]["tokens"] for n in j)
    assert j["cached"]["mode"] == "sparse-cached" and j["cached"]["kv_fetch"] == "resident"
    assert j["dual"]["kv_fetch"] == "resident" and j["sparse"]["kv_fetch"] == "on_demand"
    assert 0 < j["cached"]["reused_chunks"] and j["sparse"]["reused_chunks"] == 0
    assert j["cached"]["fetched_chunks"] < j["sparse"]["fetched_chunks"]
    # dualdecoder's prefetches may move more in all (a tiny model predicts poorly), but fewer
    # bytes wait on the critical path than sparse's whole selection.
    assert j["dual"]["bytes_per_step"]["urgent"] < j["sparse"]["bytes_per_step"]["urgent"]
    # The ring's flag is gone: refused by name, not ignored.
    gone = ddctl(*args, "--mode", "dualdecoder", "--step_cache=false")
    assert gone.returncode != 0 and "step_cache" in gone.stderr, gone.stderr
    layer = j["cached"]["per_layer"][0]
    assert layer["selected_chunks"] == layer["urgent_chunks"] + layer["reused_chunks"]
    assert j["cached"]["bytes_per_step"]["urgent"] > 0 and j["cached"]["bytes_per_step"]["prefetch"] == 0
    bad = ddctl(*args, "--mode", "sparse-cached", "--resident_margin", "5")
    assert bad.returncode != 0 and "resident margin" in bad.stderr, bad.stderr


@pytest.mark.parametrize("mode", ["full", "dualdecoder"])
def test_device_memory_budget(tiny, mode):
    """A budget is parsed with units, reported in --json, and one too small for a single
    request is refused with the numbers instead of running out of memory."""
    import json
    args = ["generate", "--model", str(tiny), "--prompt", "hello world", "--max_new_tokens", "3", "--mode", mode]
    ok = ddctl(*args, "--device_memory", "1GiB", "--json")
    assert ok.returncode == 0, ok.stderr
    mem = json.loads(ok.stdout)["device_memory"]
    assert mem["budget_bytes"] == 1 << 30
    assert 0 < mem["weights_bytes"] < 1 << 30 and mem["kv_bytes_per_request"] > 0
    small = ddctl(*args, "--device_memory", str(mem["weights_bytes"] + 1))
    assert small.returncode == 2 and "too small for even one request" in small.stderr, small.stderr
    bad = ddctl(*args, "--device_memory", "lots")
    assert bad.returncode == 2 and "--device_memory" in bad.stderr, bad.stderr


def test_predictors_change_hits_not_tokens(tiny):
    """Every predictor gives the tokens of sparse mode; oracle needs the tokens."""
    import json
    args = ["generate", "--model", str(tiny), "--prompt", "the lazy dog sleeps " * 40,
            "--max_new_tokens", "10", "--ignore_eos", "--json", "--budget", "64"]
    sparse = json.loads(ddctl(*args, "--mode", "sparse").stdout)
    dual = ["--mode", "dualdecoder"]
    oracle = ["--oracle_tokens", ",".join(str(t) for t in sparse["tokens"])]
    for extra in (["--predictor", "previous"], ["--predictor", "union"], ["--predictor", "random"],
                  ["--predictor", "oracle", *oracle]):
        r = ddctl(*args, *dual, *extra)
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert j["tokens"] == sparse["tokens"], extra
        assert j["predictor"] == extra[1]
        assert 0.0 <= j["hit_rate_after_first"] <= 1.0 and 0.0 <= j["hit_rate"] <= 1.0
    missing = ddctl(*args, *dual, "--predictor", "oracle")
    assert missing.returncode == 2 and "--oracle_tokens" in missing.stderr
    bad = ddctl(*args, *dual, "--predictor", "psychic")
    assert bad.returncode == 2 and "unknown predictor" in bad.stderr


def test_fidelity_is_zero_when_the_budget_covers_the_context(tiny, tmp_path):
    """ddctl fidelity compares sparse with full teacher-forced: a budget covering every
    selectable chunk gives KL exactly 0 (bit-identical logits); a small one gives KL > 0."""
    import json
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 60)
    base = ["fidelity", "--model", str(tiny), "--prompt_file", str(text), "--context", "200", "--score_tokens", "16",
            "--mode", "sparse"]
    same = ddctl(*base, "--budget", "2048")
    assert same.returncode == 0, same.stderr
    j = json.loads(same.stdout)
    assert j["scored"] == 16 and j["kl_max"] == 0.0 and j["ppl_full"] == j["ppl_sparse"]
    small = json.loads(ddctl(*base, "--budget", "16").stdout)
    assert small["kl_max"] > 0.0
    full = ddctl(*base[:-2], "--mode", "full", "--budget", "16")
    assert full.returncode == 2 and "sparse mode" in full.stderr
    long = ddctl(*base[:5], "--context", "100000", "--score_tokens", "16", "--mode", "sparse")
    assert long.returncode != 0 and "tokens" in long.stderr
    # Several budgets in one process (full runs once): one line each, equal to separate runs.
    both = ddctl(*base, "--budgets", "16,2048")
    assert both.returncode == 0, both.stderr
    lines = [json.loads(x) for x in both.stdout.splitlines()]
    assert [x["budget_tokens"] for x in lines] == [16, 2048]
    assert lines[0]["kl"] == small["kl"] and lines[1]["kl"] == j["kl"]
    for flags, message in ((("--budgets", "16,x"), "'x' is not a budget"),
                           (("--budgets", "16", "--each_sparse_layer", "0"), "pass one of"),
                           (("--key_ranks", "16", "--key_reconstructions", "all"), "pass one of"),
                           (("--key_ranks", "-1"), "'-1' is not a rank"),
                           (("--key_reconstructions", "sometimes"), "'sometimes' is not off, auto, all"),
                           (("--budgets", "4"), "smaller than one chunk")):
        bad = ddctl(*base, *flags)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_kv_dtype_is_reported_refused_by_name_and_its_loss_measured(tiny, tmp_path):
    """--kv_dtype f16 runs every mode and says so in --json; an unknown type is refused by name;
    fidelity with --mode full against an f32 reference measures f16's loss alone (small, not 0)."""
    import json
    for mode in ("full", "sparse", "dualdecoder"):
        r = ddctl("generate", "--model", str(tiny), "--prompt", "hello there", "--max_new_tokens", "4", "--json",
                  "--mode", mode, "--kv_dtype", "f16")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert j["kv_dtype"] == "f16" and j["kv_saturated_values"] == 0, j
    bad = ddctl("generate", "--model", str(tiny), "--prompt", "hi", "--kv_dtype", "f8")
    assert bad.returncode == 2 and "--kv_dtype = 'f8': the KV type must be f32 or f16" in bad.stderr, bad.stderr
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 60)
    r = ddctl("fidelity", "--model", str(tiny), "--prompt_file", str(text), "--context", "200", "--score_tokens", "16",
              "--mode", "full", "--kv_dtype", "f16", "--reference_kv_dtype", "f32")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["kv_dtype"] == "f16" and j["reference_kv_dtype"] == "f32"
    assert 0.0 < j["kl_max"] < 0.01, j["kl_max"]


def test_device_is_reported_and_unavailable_devices_say_why(tiny):
    # The tiny model's random text need not be UTF-8: read the output as bytes.
    r = subprocess.run([str(BIN / "ddctl"), "generate", "--model", str(tiny), "--device", "cpu", "--prompt", "hi",
                        "--max_new_tokens", "2"], capture_output=True, timeout=120)
    assert r.returncode == 0 and b"device cpu" in r.stderr, r.stderr
    r = ddctl("generate", "--model", str(tiny), "--device", "tpu", "--prompt", "hi")
    assert r.returncode == 2 and "unknown device 'tpu' (known: auto, cpu, sim, cuda)" in r.stderr, r.stderr
    # CUDA options asked of another device by name: refused, naming both.
    for flag in ("--cuda_graphs", "--cuda_copy_engine_prefetch"):
        r = ddctl("generate", "--model", str(tiny), "--device", "sim", flag, "--prompt", "hi")
        assert r.returncode != 0 and f"{flag} needs --device cuda" in r.stderr and "--device sim" in r.stderr, r.stderr
    # Without a GPU, --device cuda is refused with the reason (the missing device, driver or
    # backend): a message, not a crash. With one it runs (scripts/gpu-check).
    info = json.loads(ddctl("info", "--model", str(tiny)).stdout)
    if info["devices"]["cuda"] != "usable":
        r = ddctl("generate", "--model", str(tiny), "--device", "cuda", "--prompt", "hi")
        assert r.returncode != 0 and "--device cuda: " in r.stderr, r.stderr
    # The simulated device runs every mode with the cpu's bits (greedy: the same tokens).
    for mode in ("full", "sparse", "sparse-cached", "dualdecoder"):
        outs = {}
        for device in ("cpu", "sim"):
            r = subprocess.run([str(BIN / "ddctl"), "generate", "--model", str(tiny), "--device", device, "--mode", mode,
                                "--budget", "16", "--prompt", "hello world " * 80, "--max_new_tokens", "6",
                                "--temperature", "0"], capture_output=True, timeout=120)
            assert r.returncode == 0 and f"device {device}".encode() in r.stderr, (mode, r.stderr)
            outs[device] = r.stdout
        assert outs["sim"] == outs["cpu"] and outs["cpu"], (mode, outs)
    # The full speculative head's tokens are the argmax of logits that never leave the device
    # (Ops::ArgmaxRows): the same predictions, so the same hits, as on the cpu.
    hits = {}
    for device in ("cpu", "sim"):
        r = ddctl("generate", "--model", str(tiny), "--device", device, "--mode", "dualdecoder", "--spec_head", "full",
                  "--budget", "16", "--prompt", "hello world " * 80, "--max_new_tokens", "12", "--temperature", "0",
                  "--ignore_eos", "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        hits[device] = (j["tokens"], j["hit_rate"], j["fetched_chunks"])
    assert hits["sim"] == hits["cpu"] and hits["cpu"][1] > 0, hits
