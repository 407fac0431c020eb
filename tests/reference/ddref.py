"""Independent numpy reference for DualDecoder's decoder forward passes.

Produces golden logits for the engine's tests. It shares no code with the C++ engine: GGUF
tensors are dequantized by the `gguf` Python package (gguf.GGUFReader + gguf.quants.dequantize),
safetensors files are parsed here with plain numpy, and every architecture is written out
below as the textbook sequence of operations, in float64 unless the caller asks for float32.

    model = ddref.load("model.gguf")          # or a Hugging Face safetensors directory
    out = ddref.logits(model, [2, 651, 6037])  # float64 array [T, vocab]

Architectures: llama (GGUF "llama", HF LlamaForCausalLM), qwen2 (GGUF "qwen2",
HF Qwen2ForCausalLM) and gemma3 (GGUF "gemma3" only).

Conventions that differ between the two formats, and that this file follows:
- RoPE pairing. GGUF llama files have Q and K rows permuted by llama.cpp's converter so that
  RoPE rotates adjacent pairs (x[2i], x[2i+1]) ("normal" style). HF llama, and qwen2/gemma3 in
  both formats, rotate (x[i], x[i + d/2]) ("neox" / rotate-half style).
- Llama-3 RoPE scaling. GGUF carries per-frequency divisors in the tensor `rope_freqs.weight`;
  HF carries `rope_scaling: {rope_type: llama3, ...}` in config.json, turned into the same
  divisors here.
- Gemma3 norms. The GGUF converter already added 1 to every RMSNorm weight, so y = x/rms(x) * w.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

import gguf

__all__ = ["load", "logits", "Model", "Config", "LayerSpec", "RopeSpec"]


# --------------------------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------------------------

@dataclass
class RopeSpec:
    """Rotary embedding of one layer."""

    base: float
    dim: int                      # number of rotated dimensions at the start of each head
    style: str                    # "normal" (adjacent pairs) or "neox" (rotate-half)
    freq_divisors: np.ndarray | None = None  # llama3 scaling: inv_freq[i] /= divisors[i]
    position_scale: float = 1.0   # linear scaling: angle uses position * position_scale

    def inv_freq(self) -> np.ndarray:
        exponents = np.arange(0, self.dim, 2, dtype=np.float64) / self.dim
        inv = 1.0 / (float(self.base) ** exponents)
        if self.freq_divisors is not None:
            inv = inv / np.asarray(self.freq_divisors, dtype=np.float64)
        return inv


@dataclass
class LayerSpec:
    rope: RopeSpec
    window: int | None = None     # sliding window: query i sees key j iff i - window < j <= i


@dataclass
class Config:
    arch: str
    n_layer: int
    hidden: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    attn_scale: float
    layers: list[LayerSpec] = field(default_factory=list)
    embed_scale: float = 1.0      # gemma: sqrt(hidden)
    activation: str = "silu"      # "silu" or "gelu_tanh"
    qk_norm: bool = False         # gemma3: per-head RMSNorm on q and k before RoPE
    sandwich_norm: bool = False   # gemma3: post_attention_norm / post_ffw_norm
    final_softcap: float | None = None


# --------------------------------------------------------------------------------------------
# Tensor sources. Names are canonical GGUF names ("blk.0.attn_q.weight"); matrices are
# [out_features, in_features] like both file formats store them.
# --------------------------------------------------------------------------------------------

class GGUFTensors:
    def __init__(self, path: str):
        self.path = path
        self.reader = gguf.GGUFReader(path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def n_rows(self, name: str) -> int:
        return int(self._tensors[name].data.shape[0])

    def _dequant(self, data: np.ndarray, name: str) -> np.ndarray:
        t = self._tensors[name]
        out = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        return np.asarray(out, dtype=np.float32)

    def get(self, name: str) -> np.ndarray:
        """Whole tensor as float32 (dequantized values are exact in float32), cached."""
        if name not in self._cache:
            if name not in self._tensors:
                raise KeyError(f"{self.path}: missing tensor {name}")
            self._cache[name] = self._dequant(self._tensors[name].data, name)
        return self._cache[name]

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Selected rows only: an embedding lookup without dequantizing the whole table."""
        if name in self._cache:
            return self._cache[name][ids]
        return self._dequant(self._tensors[name].data[ids], name)

    def row_blocks(self, name: str, block: int):
        """Yields (first_row, float32 rows) so huge output matrices never sit in memory whole."""
        if name in self._cache:
            yield 0, self._cache[name]
            return
        data = self._tensors[name].data
        for start in range(0, data.shape[0], block):
            yield start, self._dequant(data[start:start + block], name)

    def field(self, key: str, default=None):
        """Metadata value: int/float/bool/str, or a list of them for arrays."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        vtype = gguf.GGUFValueType

        def scalar(part, kind):
            if kind == vtype.STRING:
                return bytes(part).decode("utf-8")
            return part.tolist()[0]

        if f.types[0] == vtype.ARRAY:
            return [scalar(f.parts[i], f.types[-1]) for i in f.data]
        return scalar(f.parts[f.data[0]], f.types[0])


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16"}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Parses a .safetensors file: u64 LE header size, JSON header, raw little-endian data."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header_len = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8:8 + header_len]).decode("utf-8"))
    base = 8 + header_len
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        buf = raw[base + begin: base + end]
        if dtype == "bf16":
            arr = (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = buf.view(np.dtype(dtype).newbyteorder("<")).astype(np.float32)
        shape = tuple(info["shape"])
        if arr.size != math.prod(shape):
            raise ValueError(f"{path}: tensor {name} size does not match its shape {shape}")
        out[name] = arr.reshape(shape)
    return out


def _hf_to_canonical(name: str) -> str | None:
    simple = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in simple:
        return simple[name]
    parts = name.split(".")
    if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers":
        return None
    layer = parts[2]
    rest = ".".join(parts[3:])
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.bias": "attn_output.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if rest not in per_layer:
        return None
    return f"blk.{layer}.{per_layer[rest]}"


class SafetensorsTensors:
    def __init__(self, directory: str):
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{directory}: no *.safetensors files")
        self._tensors: dict[str, np.ndarray] = {}
        for path in files:
            for hf_name, arr in read_safetensors(path).items():
                name = _hf_to_canonical(hf_name)
                if name is not None:
                    self._tensors[name] = arr

    def has(self, name: str) -> bool:
        return name in self._tensors

    def n_rows(self, name: str) -> int:
        return int(self._tensors[name].shape[0])

    def get(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise KeyError(f"missing tensor {name}")
        return self._tensors[name]

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self.get(name)[ids]

    def row_blocks(self, name: str, block: int):
        yield 0, self.get(name)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

@dataclass
class Model:
    config: Config
    tensors: object  # GGUFTensors or SafetensorsTensors
    source: str


def load(path: str) -> Model:
    """Loads a .gguf file or a Hugging Face directory (config.json + *.safetensors)."""
    if os.path.isdir(path):
        return _load_hf(path)
    return _load_gguf(path)


def llama3_freq_divisors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                         high_freq_factor: float, original_context: float) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling: high frequencies (short wavelengths)
    are kept, low ones divided by `factor`, and the band between interpolates smoothly."""
    inv = 1.0 / (float(base) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    out = np.empty_like(inv)
    for i, f in enumerate(inv):
        wavelen = 2.0 * math.pi / f
        if wavelen < high_freq_wavelen:
            out[i] = 1.0
        elif wavelen > low_freq_wavelen:
            out[i] = factor
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor -
                                                                      low_freq_factor)
            out[i] = 1.0 / ((1.0 - smooth) / factor + smooth)
    return out


def _scalar(value, what: str):
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise NotImplementedError(f"per-layer {what} is not supported: {value}")
        return value[0]
    return value


def _load_gguf(path: str) -> Model:
    t = GGUFTensors(path)
    arch = t.field("general.architecture")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise NotImplementedError(f"{path}: architecture {arch!r} is not supported")

    def kv(key, default=KeyError):
        v = t.field(f"{arch}.{key}")
        if v is None:
            if default is KeyError:
                raise KeyError(f"{path}: missing metadata {arch}.{key}")
            return default
        return v

    hidden = int(kv("embedding_length"))
    n_head = int(_scalar(kv("attention.head_count"), "head_count"))
    n_head_kv = int(_scalar(kv("attention.head_count_kv", n_head), "head_count_kv"))
    head_dim = int(kv("attention.key_length", hidden // n_head))
    if int(kv("attention.value_length", head_dim)) != head_dim:
        raise NotImplementedError("key_length != value_length")
    n_layer = int(kv("block_count"))
    rope_dim = int(kv("rope.dimension_count", head_dim))
    rope_base = float(kv("rope.freq_base", 10000.0))

    position_scale = 1.0
    scaling = kv("rope.scaling.type", None)
    if scaling == "linear":
        position_scale = 1.0 / float(kv("rope.scaling.factor"))
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"{path}: rope scaling {scaling!r}")
    divisors = None
    if t.has("rope_freqs.weight"):
        divisors = t.get("rope_freqs.weight").astype(np.float64).reshape(-1)

    cfg = Config(
        arch=arch, n_layer=n_layer, hidden=hidden, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, ffn=int(_scalar(kv("feed_forward_length"), "feed_forward_length")),
        vocab=t.n_rows("token_embd.weight"), eps=float(kv("attention.layer_norm_rms_epsilon")),
        attn_scale=1.0 / math.sqrt(head_dim))

    if arch in ("llama", "qwen2"):
        style = "normal" if arch == "llama" else "neox"
        rope = RopeSpec(rope_base, rope_dim, style, divisors, position_scale)
        cfg.layers = [LayerSpec(rope) for _ in range(n_layer)]
    else:  # gemma3
        cfg.embed_scale = math.sqrt(hidden)
        cfg.activation = "gelu_tanh"
        cfg.qk_norm = True
        cfg.sandwich_norm = True
        cfg.final_softcap = kv("final_logit_softcapping", None)
        # llama.cpp uses 1/sqrt(key_length) except for the 27B model (hidden/n_head there).
        cfg.attn_scale = float(kv("attention.scale", 1.0 / math.sqrt(head_dim)))
        window = kv("attention.sliding_window", None)
        # Defaults below are llama.cpp's for gemma3 when the file has no key: every 6th layer
        # (il % 6 == 5) is global, local layers use rope base 10000 and no rope scaling.
        pattern = kv("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            is_local = [bool(p) for p in pattern]
        else:
            pattern = int(pattern)
            is_local = [pattern > 0 and il % pattern < pattern - 1 for il in range(n_layer)]
        local_base = float(kv("rope.freq_base_swa", 10000.0))
        global_rope = RopeSpec(rope_base, rope_dim, "neox", divisors, position_scale)
        local_rope = RopeSpec(local_base, rope_dim, "neox")
        cfg.layers = [
            LayerSpec(local_rope, int(window)) if (window and is_local[il])
            else LayerSpec(global_rope)
            for il in range(n_layer)
        ]
    return Model(cfg, t, path)


def _load_hf(directory: str) -> Model:
    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if "LlamaForCausalLM" in archs:
        arch = "llama"
    elif "Qwen2ForCausalLM" in archs:
        arch = "qwen2"
        if hf.get("use_sliding_window", False):
            raise NotImplementedError("qwen2 use_sliding_window=true")
    else:
        raise NotImplementedError(f"{directory}: architectures {archs} not supported")

    t = SafetensorsTensors(directory)
    hidden = int(hf["hidden_size"])
    n_head = int(hf["num_attention_heads"])
    n_head_kv = int(hf.get("num_key_value_heads") or n_head)
    head_dim = int(hf.get("head_dim") or hidden // n_head)
    base = float(hf.get("rope_theta", 10000.0))

    divisors = None
    position_scale = 1.0
    rs = hf.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            divisors = llama3_freq_divisors(
                head_dim, base, float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                float(rs.get("high_freq_factor", 4.0)),
                float(rs.get("original_max_position_embeddings", 8192)))
        elif kind == "linear":
            position_scale = 1.0 / float(rs["factor"])
        elif kind not in (None, "default"):
            raise NotImplementedError(f"rope_scaling {kind!r}")

    # Tied when the checkpoint has no lm_head; an explicit lm_head wins only if untied.
    if hf.get("tie_word_embeddings", False) and t.has("output.weight"):
        t._tensors.pop("output.weight")

    rope = RopeSpec(base, head_dim, "neox", divisors, position_scale)
    cfg = Config(
        arch=arch, n_layer=int(hf["num_hidden_layers"]), hidden=hidden, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, ffn=int(hf["intermediate_size"]),
        vocab=t.n_rows("token_embd.weight"), eps=float(hf["rms_norm_eps"]),
        attn_scale=1.0 / math.sqrt(head_dim))
    cfg.layers = [LayerSpec(rope) for _ in range(cfg.n_layer)]
    return Model(cfg, t, directory)


# --------------------------------------------------------------------------------------------
# Forward pass
# --------------------------------------------------------------------------------------------

def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w.astype(x.dtype)


def _apply_rope(x: np.ndarray, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """x: [T, heads, head_dim]; rotates the first spec.dim dimensions of every head."""
    angles = (positions.astype(np.float64) * spec.position_scale)[:, None] * spec.inv_freq()
    cos = np.cos(angles).astype(x.dtype)[:, None, :]  # [T, 1, dim/2]
    sin = np.sin(angles).astype(x.dtype)[:, None, :]
    rot, rest = x[..., :spec.dim], x[..., spec.dim:]
    if spec.style == "normal":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    elif spec.style == "neox":
        half = spec.dim // 2
        a, b = rot[..., :half], rot[..., half:]
        out = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:
        raise ValueError(spec.style)
    return np.concatenate([out, rest], axis=-1)


def _attention(q, k, v, scale: float, window: int | None) -> np.ndarray:
    """q: [T, H, d]; k, v: [T, Hkv, d]. Full causal (optionally windowed) softmax attention."""
    T, H, d = q.shape
    group = H // k.shape[1]
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    out = np.empty_like(q)
    for h in range(H):
        kv = h // group
        scores = (q[:, h, :] @ k[:, kv, :].T) * scale
        scores = np.where(allowed, scores, -np.inf)
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, kv, :]
    return out.reshape(T, H * d)


def _linear(model: Model, x: np.ndarray, name: str) -> np.ndarray:
    t = model.tensors
    y = x @ t.get(name + ".weight").astype(x.dtype).T
    if t.has(name + ".bias"):
        y = y + t.get(name + ".bias").astype(x.dtype)
    return y


def _activation(kind: str, x: np.ndarray) -> np.ndarray:
    if kind == "silu":
        return x / (1.0 + np.exp(-x))
    if kind == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x * x * x)))
    raise ValueError(kind)


def _layer(model: Model, il: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    cfg = model.config
    t = model.tensors
    spec = cfg.layers[il]
    p = f"blk.{il}."
    T = x.shape[0]

    h = _rms_norm(x, t.get(p + "attn_norm.weight"), cfg.eps)
    q = _linear(model, h, p + "attn_q").reshape(T, cfg.n_head, cfg.head_dim)
    k = _linear(model, h, p + "attn_k").reshape(T, cfg.n_head_kv, cfg.head_dim)
    v = _linear(model, h, p + "attn_v").reshape(T, cfg.n_head_kv, cfg.head_dim)
    if cfg.qk_norm:
        q = _rms_norm(q, t.get(p + "attn_q_norm.weight"), cfg.eps)
        k = _rms_norm(k, t.get(p + "attn_k_norm.weight"), cfg.eps)
    q = _apply_rope(q, positions, spec.rope)
    k = _apply_rope(k, positions, spec.rope)
    attn = _linear(model, _attention(q, k, v, cfg.attn_scale, spec.window), p + "attn_output")
    if cfg.sandwich_norm:
        attn = _rms_norm(attn, t.get(p + "post_attention_norm.weight"), cfg.eps)
    x = x + attn

    h = _rms_norm(x, t.get(p + "ffn_norm.weight"), cfg.eps)
    gate = _linear(model, h, p + "ffn_gate")
    up = _linear(model, h, p + "ffn_up")
    ffn = _linear(model, _activation(cfg.activation, gate) * up, p + "ffn_down")
    if cfg.sandwich_norm:
        ffn = _rms_norm(ffn, t.get(p + "post_ffw_norm.weight"), cfg.eps)
    return x + ffn


def logits(model: Model, token_ids, positions=None, dtype=np.float64) -> np.ndarray:
    """Logits [len(positions), vocab] after a causal pass over all of token_ids.

    positions defaults to every position. dtype float64 is the reference; float32 exists
    only to estimate how far an honest float32 implementation may drift from it.
    """
    cfg = model.config
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("no tokens")
    if ids.min() < 0 or ids.max() >= cfg.vocab:
        raise ValueError(f"token id out of range [0, {cfg.vocab})")
    T = ids.size
    pos = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos.min() < 0 or pos.max() >= T:
        raise ValueError("position out of range")

    t = model.tensors
    x = t.rows("token_embd.weight", ids).astype(dtype) * dtype(cfg.embed_scale)
    all_positions = np.arange(T)
    for il in range(cfg.n_layer):
        x = _layer(model, il, x, all_positions)

    h = _rms_norm(x[pos], t.get("output_norm.weight"), cfg.eps)
    out_name = "output.weight" if t.has("output.weight") else "token_embd.weight"
    out = np.empty((pos.size, t.n_rows(out_name)), dtype=dtype)
    for start, rows in t.row_blocks(out_name, 16384):
        out[:, start:start + rows.shape[0]] = h @ rows.astype(dtype).T
    if cfg.final_softcap:
        cap = float(cfg.final_softcap)
        out = np.tanh(out / cap) * cap
    return out


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Golden logits from the numpy reference")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--positions", help="comma-separated positions (default: all)")
    ap.add_argument("--out", help="write float32 .npy here")
    args = ap.parse_args()
    ids = [int(s) for s in args.tokens.split(",") if s]
    positions = [int(s) for s in args.positions.split(",")] if args.positions else None
    out = logits(load(args.model), ids, positions)
    if args.out:
        np.save(args.out, out.astype(np.float32))
    print("argmax:", ",".join(str(int(a)) for a in out.argmax(axis=1)))


if __name__ == "__main__":
    _main()
