"""`--sparse_layers`: only the listed global layers are sparse, the others attend densely
(per-layer fidelity, eval/fidelity.py --standard). Real Gemma (global layers 5, 11, 17)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_answer import real_model  # noqa: E402
from test_ddctl import ddctl  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()[:20000]


def fidelity(model, tmp_path, *flags):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    r = ddctl("fidelity", "--model", str(model), "--prompt_file", str(p), "--context", "1024", "--score_tokens", "12",
              "--mode", "sparse", "--budget", "128", *flags, timeout=600)
    return r


def test_one_sparse_layer_at_a_time(tmp_path):
    model = real_model()
    info = json.loads(ddctl("info", "--model", str(model)).stdout)
    layers = info["global_layers"]
    assert len(layers) >= 2
    runs = {}
    for flags in ((), ("--sparse_layers", ",".join(map(str, layers))), *(("--sparse_layers", str(x)) for x in layers)):
        r = fidelity(model, tmp_path, *flags)
        assert r.returncode == 0, r.stderr
        runs[flags[1] if flags else "default"] = json.loads(r.stdout)["kl"]
    # Listing every global layer is the default, bit for bit.
    assert runs[",".join(map(str, layers))] == runs["default"]
    # One sparse layer: some loss, and not the same loss as all of them or as another layer.
    singles = [runs[str(x)] for x in layers]
    for kl in singles:
        assert max(kl) > 0 and kl != runs["default"]
    assert singles[0] != singles[1]
    # All layers in one process (one full run for all): the same KL as the separate runs.
    r = fidelity(model, tmp_path, "--each_sparse_layer", ",".join(map(str, layers)))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["sparse_layers"] for x in lines] == [[x] for x in layers]
    assert [x["kl"] for x in lines] == singles


@pytest.mark.parametrize("flags, message", [
    (("--sparse_layers", "4"), "is not a global layer of this model"),
    (("--sparse_layers", "5,5"), "listed twice"),
    (("--sparse_layers", "x"), "is not a layer index"),
    (("--each_sparse_layer", "4"), "is not a global layer of this model"),
])
def test_bad_sparse_layers_are_named(tmp_path, flags, message):
    model = real_model()
    r = fidelity(model, tmp_path, *flags)
    assert r.returncode == 2 and message in r.stderr, r.stderr
