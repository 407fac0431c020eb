#!/usr/bin/env python3
"""Evidence for REL_TOL in test_reference.py (run by hand; not a test, takes a few minutes).

    python3 tests/reference/tolerance_study.py [--gemma PATH] [--skip-gemma]

For each model it prints, relative to max(1, max|reference logit|), how far
  - ddref computed in float32 (what an honest float32 engine may drift) and
  - deliberately broken copies of the reference (wrong window, RoPE base, pairing, ...)
land from the float64 reference. A useful tolerance sits well above the first and well below
the second. The broken copies are made by editing a copy of the model's Config or by swapping
one ddref function for the duration of a run; ddref itself is not changed.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "eval"))

import ddref  # noqa: E402
import make_synthetic  # noqa: E402
import models  # noqa: E402
from test_reference import (GEMMA_POSITIONS, GEMMA_TOKENS, LONG_TEXT, REL_TOL,  # noqa: E402
                            SYNTHETIC_SEED)


def greedy_spm_tokens(model: ddref.Model, text: str) -> list[int]:
    """Score-greedy SentencePiece-style BPE with byte fallback; good enough for a study
    (the tests themselves take Gemma's tokens from ddctl)."""
    pieces = model.tensors.field("tokenizer.ggml.tokens")
    scores = model.tensors.field("tokenizer.ggml.scores")
    index = {p: i for i, p in enumerate(pieces)}
    syms = list(text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = index.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    ids = [int(model.tensors.field("tokenizer.ggml.bos_token_id"))]
    for s in syms:
        if s in index:
            ids.append(index[s])
        else:
            ids.extend(index["<0x%02X>" % b] for b in s.encode("utf-8"))
    return ids


class Variant:
    def __init__(self, name, mutate=None, patch=None):
        self.name, self.mutate, self.patch = name, mutate, patch or {}

    def run(self, model, tokens, positions):
        broken = ddref.Model(copy.deepcopy(model.config), model.tensors, model.source)
        if self.mutate:
            self.mutate(broken.config)
        saved = {k: getattr(ddref, k) for k in self.patch}
        try:
            for k, v in self.patch.items():
                setattr(ddref, k, v)
            return ddref.logits(broken, tokens, positions)
        finally:
            for k, v in saved.items():
                setattr(ddref, k, v)


def set_rope(pred, **changes):
    def mutate(cfg):
        for layer in cfg.layers:
            if pred(layer):
                layer.rope = copy.copy(layer.rope)
                for k, v in changes.items():
                    setattr(layer.rope, k, v)
    return mutate


def set_window(w):
    def mutate(cfg):
        for layer in cfg.layers:
            if layer.window:
                layer.window = w
    return mutate


_orig_attention = ddref._attention
_orig_activation = ddref._activation
_orig_linear = ddref._linear


def gqa_interleaved(q, k, v, scale, window):
    T, H, d = q.shape
    out = np.empty_like(q)
    for h in range(H):
        kv = h % k.shape[1]
        out[:, h] = _orig_attention(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], scale,
                                    window).reshape(T, d)
    return out.reshape(T, H * d)


def gelu_erf(kind, x):
    if kind != "gelu_tanh":
        return _orig_activation(kind, x)
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def no_k_bias(model, x, name):
    if name.endswith("attn_k"):
        return x @ model.tensors.get(name + ".weight").astype(x.dtype).T
    return _orig_linear(model, x, name)


def common_variants(cfg):
    out = [
        Variant("RoPE pairing swapped", set_rope(lambda l: True, style="normal"
                                                 if cfg.layers[0].rope.style == "neox"
                                                 else "neox")),
        Variant("RoPE base x10", set_rope(lambda l: True, base=cfg.layers[0].rope.base * 10)),
        Variant("GQA head -> kv head as h % n_kv", patch={"_attention": gqa_interleaved}),
        Variant("RMSNorm eps x10", lambda c: setattr(c, "eps", c.eps * 10)),
    ]
    if cfg.arch == "llama":
        out.append(Variant("Llama-3 rope_freqs ignored",
                           set_rope(lambda l: True, freq_divisors=None)))
    if cfg.arch == "qwen2":
        out.append(Variant("k bias dropped", patch={"_linear": no_k_bias}))
    return out


def gemma_variants():
    local, glob = (lambda l: l.window is not None), (lambda l: l.window is None)
    return [
        Variant("sliding window 511", set_window(511)),
        Variant("sliding window 513", set_window(513)),
        Variant("global rope base 1e4", set_rope(glob, base=10000.0)),
        Variant("local rope base 1e6", set_rope(local, base=1e6)),
        Variant("RoPE pairing normal", set_rope(lambda l: True, style="normal")),
        Variant("global layers off by one", lambda c: setattr(c, "layers",
                                                              c.layers[1:] + c.layers[:1])),
        Variant("no q/k norm", lambda c: setattr(c, "qk_norm", False)),
        Variant("attention scale 1/sqrt(hidden/heads)",
                lambda c: setattr(c, "attn_scale", 1.0 / math.sqrt(c.hidden / c.n_head))),
        Variant("RMSNorm eps 1e-5", lambda c: setattr(c, "eps", 1e-5)),
        Variant("embedding scale 25.25 (bf16 sqrt)", lambda c: setattr(c, "embed_scale", 25.25)),
        Variant("GELU erf instead of tanh", patch={"_activation": gelu_erf}),
    ]


def study(title, model, tokens, positions, variants):
    ref = ddref.logits(model, tokens, positions)
    scale = max(1.0, float(np.abs(ref).max()))
    pos = positions if positions is not None else list(range(len(tokens)))
    print(f"\n== {title}: {len(tokens)} tokens, scale {scale:.2f}, REL_TOL {REL_TOL:g}")

    def line(name, out):
        per = np.abs(out - ref).max(axis=1) / scale
        verdict = "caught" if per.max() > REL_TOL else "within tolerance"
        detail = ""
        if positions is not None:
            detail = "  " + " ".join(f"{p}:{e:.1e}" for p, e in zip(pos, per))
        print(f"  {name:38s} {per.max():9.2e}  {verdict:16s}{detail}", flush=True)

    line("float32 (honest engine estimate)", ddref.logits(model, tokens, positions, np.float32))
    for v in variants:
        line(v.name, v.run(model, tokens, positions))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default=str(models.model_path("gemma")))
    ap.add_argument("--skip-gemma", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        make_synthetic.generate(tmp, SYNTHETIC_SEED)
        for arch in ("llama", "qwen2"):
            model = ddref.load(f"{tmp}/tiny-{arch}.gguf")
            bos = int(model.tensors.field("tokenizer.ggml.bos_token_id"))
            rng = np.random.default_rng(1234)
            tokens = [bos] + [int(x) for x in rng.integers(0, 509, 39)]
            study(f"tiny-{arch}.gguf", model, tokens, None, common_variants(model.config))

    if args.skip_gemma or not Path(args.gemma).is_file():
        print("\n(gemma skipped)")
        return
    model = ddref.load(args.gemma)
    text = LONG_TEXT.read_text(encoding="utf-8")[:4000]
    tokens = greedy_spm_tokens(model, text)[:GEMMA_TOKENS]
    study("gemma-3-270m", model, tokens, GEMMA_POSITIONS, gemma_variants())


if __name__ == "__main__":
    main()
