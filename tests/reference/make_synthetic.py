#!/usr/bin/env python3
"""Writes tiny random-weight models for the engine's tests, deterministically for a seed.

    python3 make_synthetic.py --out DIR [--seed N]

DIR/tiny-llama.gguf + DIR/tiny-llama-st/   llama, Llama-3 RoPE scaling, untied output
DIR/tiny-qwen2.gguf + DIR/tiny-qwen2-st/   qwen2, QKV biases, tied embeddings, vocab padded

Each GGUF file and its safetensors directory hold the same weights: the GGUF tensors are
written first (quantized where the type asks for it) and the safetensors tensors are their
dequantized values (gguf.quants.dequantize), in Hugging Face names and layout (llama Q/K rows
un-permuted). Between them the two GGUF files use every tensor type the engine must read:
F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K. gguf-py cannot quantize the K types; their
blocks are random bytes with small finite f16 scales, and any such bytes are valid blocks.

The tokenizer is a small GPT-2 byte-level BPE: 256 byte tokens, merges learned here from a
short English text, and special tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import Counter

import numpy as np

import gguf

T = gguf.GGMLQuantizationType

HIDDEN = 256
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 64
FFN = 512
CONTEXT = 2048
N_MERGES = 250

# Llama-3 style RoPE scaling, with a short "original context" so that the scaled, smooth and
# unscaled frequency bands all matter within a few dozen positions.
LLAMA_ROPE_THETA = 10000.0
LLAMA_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
QWEN2_ROPE_THETA = 1000000.0

# Tensor type of every weight matrix. Each file uses all eight types.
LLAMA_TYPES = {
    "token_embd": T.Q6_K, "output": T.Q8_0,
    0: {"attn_q": T.F16, "attn_k": T.BF16, "attn_v": T.Q5_0, "attn_output": T.Q4_K,
        "ffn_gate": T.Q5_K, "ffn_up": T.Q6_K, "ffn_down": T.F32},
    1: {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
        "ffn_gate": T.F16, "ffn_up": T.BF16, "ffn_down": T.Q5_0},
}
QWEN2_TYPES = {
    "token_embd": T.Q4_K,
    0: {"attn_q": T.Q5_K, "attn_k": T.Q6_K, "attn_v": T.F16, "attn_output": T.BF16,
        "ffn_gate": T.Q5_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_K},
    1: {"attn_q": T.F32, "attn_k": T.Q8_0, "attn_v": T.Q4_K, "attn_output": T.Q6_K,
        "ffn_gate": T.BF16, "ffn_up": T.F16, "ffn_down": T.Q5_K},
}

# Standard deviation of each weight matrix. q/k are large enough that attention is peaked
# (so RoPE and masking mistakes move the logits), the output projection gives logits of a
# few units.
STD = {"token_embd": 1.0, "output": 0.25, "attn_q": 0.1, "attn_k": 0.1, "attn_v": 0.0625,
       "attn_output": 0.0625, "ffn_gate": 0.0625, "ffn_up": 0.0625, "ffn_down": 0.044}
TIED_EMBD_STD = 0.25

HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

CORPUS = """\
The river wound slowly through the valley, and the people of the town watched it every
morning. When the rain came in the spring, the water rose over the old stone bridge, and the
children ran to the hill to see the fields turn into a lake. Their parents talked about the
harvest, about the price of bread and about the long winter that had just ended.
A small library stood near the market square. It was open on Monday, Wednesday and Friday,
from nine in the morning until six in the evening. The librarian, a patient woman with
silver glasses, knew where every book was kept. She liked to say that a good question is
worth more than a quick answer, and that reading is the cheapest way to travel.
In 1987 the town built a new school with twelve classrooms, a kitchen and a garden. The
students planted apple trees, tomatoes and beans; they measured the rain, counted the birds
and wrote down what they found. Some of them later became teachers, engineers, doctors or
farmers, but most of them still remember the smell of the garden after a storm.
Computers arrived much later. At first there was only one machine, and it was slow, noisy
and often broken. Today every student has a laptop, and the network connects the school to
the rest of the world. Still, the teachers say that thinking carefully, writing clearly and
listening to each other are the skills that matter most.
"""

# Approximation of the GPT-2 / Llama-3 pre-tokenizer with the stdlib `re` module (no \\p{L}):
# only used to learn merges, which are valid whatever split produced them.
TRAIN_SPLIT = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+"
                         r"|\s+(?!\S)|\s+")

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def byte_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's reversible byte -> printable character map, in GPT-2's vocabulary order:
    printable Latin-1 bytes map to themselves, the rest to U+0100 onwards."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
                 list(range(ord("®"), ord("ÿ") + 1)))
    pairs = [(b, chr(b)) for b in printable]
    extra = 0
    for b in range(256):
        if b not in printable:
            pairs.append((b, chr(256 + extra)))
            extra += 1
    return pairs


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    table = dict(byte_to_unicode())
    words = Counter(
        tuple(table[b] for b in piece.encode("utf-8")) for piece in TRAIN_SPLIT.findall(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += count
        if not pairs:
            raise RuntimeError("corpus too small for the requested number of merges")
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter = Counter()
        for word, count in words.items():
            out = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


class Vocab:
    def __init__(self, specials: list[str], padded_size: int | None = None):
        self.merges = learn_merges(CORPUS, N_MERGES)
        self.tokens = [ch for _, ch in byte_to_unicode()]
        for a, b in self.merges:
            if a + b in self.tokens:
                raise RuntimeError(f"duplicate merge result {a + b!r}")
            self.tokens.append(a + b)
        self.n_normal = len(self.tokens)
        self.specials = {s: len(self.tokens) + i for i, s in enumerate(specials)}
        self.tokens += specials
        self.n_real = len(self.tokens)
        self.size = padded_size or self.n_real
        assert self.size >= self.n_real

    def gguf_tokens(self) -> tuple[list[str], list[int]]:
        """Token strings and types as llama.cpp's converter writes them: normal 1, control 3,
        padding entries "[PADn]" unused 5."""
        tokens, types = [], []
        for i in range(self.size):
            if i < self.n_normal:
                tokens.append(self.tokens[i])
                types.append(int(gguf.TokenType.NORMAL))
            elif i < self.n_real:
                tokens.append(self.tokens[i])
                types.append(int(gguf.TokenType.CONTROL))
            else:
                tokens.append(f"[PAD{i}]")
                types.append(int(gguf.TokenType.UNUSED))
        return tokens, types

    def tokenizer_json(self, regex: str, bos: str | None, ignore_merges: bool,
                       nfc: bool) -> dict:
        added = [{"id": i, "content": s, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}
                 for s, i in self.specials.items()]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": False}
        if bos is None:
            post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False}
        else:
            bos_id = self.specials[bos]
            post = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                               {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": bos, "type_id": 1}},
                             {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": {"type": "NFC"} if nfc else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                 "invert": False},
                byte_level]},
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": ignore_merges,
                      "vocab": {tok: i for i, tok in enumerate(self.tokens)},
                      "merges": [f"{a} {b}" for a, b in self.merges]},
        }


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

K_BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def _random_kquant(rng: np.random.Generator, rows: int, cols: int, qtype, std: float):
    """Random K-quant blocks whose f16 scale fields are set so values have about `std`."""
    nb = cols // 256
    bpb = K_BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(rows, nb, bpb), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=(rows, nb))

    def set_scales(d: np.ndarray) -> np.ndarray:
        d16 = d.astype(np.float16)
        if qtype == T.Q6_K:       # ql[128] qh[64] scales[16] d
            raw[:, :, 208:210] = d16.view(np.uint8).reshape(rows, nb, 2)
        else:                     # d dmin scales[12] (qh[32]) qs[128]
            # value = d*sc*q - dmin*m with q uniform in [0, 15] or [0, 31]: this dmin
            # centres the values near zero.
            centre = 7.5 if qtype == T.Q4_K else 15.5
            dmin16 = (d * centre).astype(np.float16)
            raw[:, :, 0:2] = d16.view(np.uint8).reshape(rows, nb, 2)
            raw[:, :, 2:4] = dmin16.view(np.uint8).reshape(rows, nb, 2)
        flat = raw.reshape(rows, nb * bpb)
        return gguf.quants.dequantize(flat, qtype)

    trial = set_scales(np.full((rows, nb), 1e-3) * jitter)
    d = 1e-3 * std / float(np.std(trial)) * jitter
    values = set_scales(d)
    if not np.all(np.isfinite(values)):
        raise RuntimeError("non-finite K-quant values")
    return raw.reshape(rows, nb * bpb), values


def make_matrix(rng: np.random.Generator, rows: int, cols: int, qtype, std: float):
    """Returns (data to write into the GGUF, its true float32 values [rows, cols])."""
    if qtype in K_BLOCK_BYTES:
        raw, values = _random_kquant(rng, rows, cols, qtype, std)
    else:
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
        values = gguf.quants.dequantize(raw, qtype)
    values = np.asarray(values, dtype=np.float32).reshape(rows, cols)
    return raw, values


def permute_rows_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's adjacent-pair order, per head: GGUF row 2j+t
    of a head is HF row t*d/2 + j."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors() -> np.ndarray:
    rs = LLAMA_ROPE_SCALING
    inv = 1.0 / (LLAMA_ROPE_THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM))
    orig = rs["original_max_position_embeddings"]
    low, high, factor = rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def narrowest_exact_dtype(qtype) -> str:
    return {T.BF16: "BF16", T.F16: "F16"}.get(qtype, "F32")


def write_safetensors(path: str, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """tensors: name -> (float32 values, "F32" | "F16" | "BF16"); values must be exact."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        values, dtype = tensors[name]
        values = np.ascontiguousarray(values, dtype=np.float32)
        if dtype == "F32":
            blob = values.astype("<f4").tobytes()
        elif dtype == "F16":
            half = values.astype("<f2")
            assert np.array_equal(half.astype(np.float32), values), name
            blob = half.tobytes()
        elif dtype == "BF16":
            bits = values.view(np.uint32)
            assert np.all((bits & 0xFFFF) == 0), name
            blob = (bits >> 16).astype("<u2").tobytes()
        else:
            raise ValueError(dtype)
        header[name] = {"dtype": dtype, "shape": list(values.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def build(out_dir: str, seed: int, arch: str) -> None:
    rng = np.random.default_rng([seed, 0 if arch == "llama" else 1])
    if arch == "llama":
        vocab = Vocab(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                       "<|end_header_id|>", "<|eot_id|>"])
        types, tied, eps, theta = LLAMA_TYPES, False, 1e-5, LLAMA_ROPE_THETA
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    else:
        # Padded like real Qwen2 checkpoints: the embedding has more rows than the tokenizer.
        vocab = Vocab(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], padded_size=512)
        types, tied, eps, theta = QWEN2_TYPES, True, 1e-6, QWEN2_ROPE_THETA
        bos, eos = "<|endoftext|>", "<|im_end|>"

    gguf_tensors: list[tuple[str, np.ndarray, object]] = []  # name, data, raw_dtype
    hf: dict[str, tuple[np.ndarray, str]] = {}

    def matrix(gguf_name: str, hf_name: str, rows: int, cols: int, qtype, std: float,
               permute_heads: int = 0):
        raw, values = make_matrix(rng, rows, cols, qtype, std)
        gguf_tensors.append((gguf_name, raw, qtype))
        if permute_heads:
            values = unpermute_rows_from_gguf(values, permute_heads)
        hf[hf_name] = (values, narrowest_exact_dtype(qtype))

    def vector(gguf_name: str, hf_name: str, values: np.ndarray):
        values = values.astype(np.float32)
        gguf_tensors.append((gguf_name, values, T.F32))
        hf[hf_name] = (values, "F32")

    matrix("token_embd.weight", "model.embed_tokens.weight", vocab.size, HIDDEN,
           types["token_embd"], TIED_EMBD_STD if tied else STD["token_embd"])
    for il in range(N_LAYER):
        g, h = f"blk.{il}.", f"model.layers.{il}."
        vector(g + "attn_norm.weight", h + "input_layernorm.weight",
               1.0 + 0.1 * rng.standard_normal(HIDDEN))
        shapes = {"attn_q": (N_HEAD * HEAD_DIM, HIDDEN), "attn_k": (N_HEAD_KV * HEAD_DIM, HIDDEN),
                  "attn_v": (N_HEAD_KV * HEAD_DIM, HIDDEN),
                  "attn_output": (HIDDEN, N_HEAD * HEAD_DIM),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            heads = 0
            if arch == "llama" and name == "attn_q":
                heads = N_HEAD
            elif arch == "llama" and name == "attn_k":
                heads = N_HEAD_KV
            rows, cols = shapes[name]
            matrix(g + name + ".weight", h + HF_LAYER_NAMES[name] + ".weight", rows, cols,
                   types[il][name], STD[name], heads)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                vector(g + name + ".bias", h + HF_LAYER_NAMES[name] + ".bias",
                       0.3 * rng.standard_normal(rows))
        vector(g + "ffn_norm.weight", h + "post_attention_layernorm.weight",
               1.0 + 0.1 * rng.standard_normal(HIDDEN))
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            rows, cols = shapes[name]
            matrix(g + name + ".weight", h + HF_LAYER_NAMES[name] + ".weight", rows, cols,
                   types[il][name], STD[name])
    vector("output_norm.weight", "model.norm.weight", 1.0 + 0.1 * rng.standard_normal(HIDDEN))
    if not tied:
        matrix("output.weight", "lm_head.weight", vocab.size, HIDDEN, types["output"],
               STD["output"])
    if arch == "llama":
        # Only the GGUF file carries the divisors; config.json carries rope_scaling.
        gguf_tensors.append(("rope_freqs.weight", llama3_rope_divisors(), T.F32))

    # ---- GGUF ----
    path = os.path.join(out_dir, f"tiny-{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(vocab.size)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, token_types = vocab.gguf_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges([f"{a} {b}" for a, b in vocab.merges])
    w.add_bos_token_id(vocab.specials[bos])
    w.add_eos_token_id(vocab.specials[eos])
    if arch == "qwen2":
        w.add_pad_token_id(vocab.specials["<|endoftext|>"])
    w.add_add_bos_token(arch == "llama")
    for name, data, qtype in gguf_tensors:
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # ---- Hugging Face directory ----
    st_dir = os.path.join(out_dir, f"tiny-{arch}-st")
    os.makedirs(st_dir, exist_ok=True)
    write_safetensors(os.path.join(st_dir, "model.safetensors"), hf)
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD_KV,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": dict(LLAMA_ROPE_SCALING) if arch == "llama" else None,
        "max_position_embeddings": CONTEXT,
        "vocab_size": vocab.size,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.specials[bos],
        "eos_token_id": vocab.specials[eos],
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        config.update({"attention_bias": False, "mlp_bias": False})
    else:
        # As in released Qwen2 configs: a sliding window is declared but switched off.
        config.update({"use_sliding_window": False, "sliding_window": CONTEXT,
                       "max_window_layers": N_LAYER})
    with open(os.path.join(st_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if arch == "llama":
        tok = vocab.tokenizer_json(LLAMA3_REGEX, bos, ignore_merges=True, nfc=False)
    else:
        tok = vocab.tokenizer_json(QWEN2_REGEX, None, ignore_merges=False, nfc=True)
    with open(os.path.join(st_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
    tok_config = {"bos_token": bos if arch == "llama" else None, "eos_token": eos,
                  "add_bos_token": arch == "llama", "add_eos_token": False,
                  "model_max_length": CONTEXT, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(st_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=2)


def generate(out_dir: str, seed: int = 0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for arch in ("llama", "qwen2"):
        build(out_dir, seed, arch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    generate(args.out, args.seed)


if __name__ == "__main__":
    main()
