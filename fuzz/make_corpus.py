"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/seed-*): small inputs made
here, valid and broken, that reach deep into each reader. Run from the repo root:
    python3 fuzz/make_corpus.py
Crashes found later are added beside them as crash-<sha1> files (scripts/fuzz keeps them)."""
import json
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def put(target, name, data):
    d = HERE / "corpus" / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def gguf_seeds():
    import gguf  # the gguf package from scripts/requirements.txt
    tmp = HERE / "corpus" / "gguf" / ".tmp.gguf"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    n_embd, n_vocab, n_ff = 8, 6, 16
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<s>", "</s>", "Ġ"])
    w.add_token_types([1, 1, 1, 3, 3, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(3)
    w.add_eos_token_id(4)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,),
              "blk.0.attn_norm.weight": (n_embd,), "blk.0.attn_q.weight": (n_embd, n_embd),
              "blk.0.attn_k.weight": (n_embd // 2, n_embd), "blk.0.attn_v.weight": (n_embd // 2, n_embd),
              "blk.0.attn_output.weight": (n_embd, n_embd), "blk.0.ffn_norm.weight": (n_embd,),
              "blk.0.ffn_gate.weight": (n_ff, n_embd), "blk.0.ffn_up.weight": (n_ff, n_embd),
              "blk.0.ffn_down.weight": (n_embd, n_ff)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    good = tmp.read_bytes()
    tmp.unlink()
    put("gguf", "seed-tiny-llama", good)
    put("gguf", "seed-truncated-header", good[:40])
    put("gguf", "seed-truncated-data", good[:len(good) - 64])
    # Header claiming 2^40 tensors and 2^40 metadata entries.
    put("gguf", "seed-huge-counts", b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40))
    put("gguf", "seed-not-gguf", b"GGUX" + bytes(60))


def safetensors_seeds():
    def st(header, payload):
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + payload
    put("safetensors", "seed-valid", st({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                                         "__metadata__": {"format": "pt"}}, bytes(16)))
    put("safetensors", "seed-bf16", st({"b": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)))
    put("safetensors", "seed-offsets-past-end", st({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}},
                                                   bytes(16)))
    put("safetensors", "seed-overflowing-shape",
        st({"w": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 16]}}, bytes(16)))
    put("safetensors", "seed-huge-header-length", struct.pack("<Q", 1 << 60) + b"{}")


def tokenizer_json_seeds():
    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "<s>": 4}
    tj = {"version": "1.0", "added_tokens": [{"id": 4, "content": "<s>", "special": True}],
          "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
          "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}
    put("tokenizer_json", "seed-bpe", json.dumps(tj))
    tj2 = dict(tj, model={"type": "BPE", "vocab": vocab, "merges": [["a", "b"]]})
    put("tokenizer_json", "seed-bpe-merge-pairs", json.dumps(tj2))
    put("tokenizer_json", "seed-wordpiece", json.dumps(dict(tj, model={"type": "WordPiece", "vocab": vocab})))
    put("tokenizer_json", "seed-not-json", "{\"model\": [")


def tenants_seeds():
    put("tenants", "seed-valid", json.dumps([{"name": "a", "token": "0123456789abcdef0123", "quota": "2MiB"},
                                              {"name": "b", "token": "fedcba98765432100123", "quota": "1TiB"}]))
    put("tenants", "seed-bad-quota", json.dumps([{"name": "a", "token": "0123456789abcdef", "quota": "-1G"}]))
    put("tenants", "seed-api-keys", json.dumps([{"tenant": "t", "key": "k" * 40}]))
    put("tenants", "seed-not-json", "[{\"name\": ")


def prompt_seeds():
    for i, text in enumerate(["Hello, world!", "<start_of_turn>user\nhi<end_of_turn>\n", "<|im_start|>system\n",
                              "\u2581\u2581 spaces  and\ttabs\n", "数字 123 ünïcödé 🤖"]):
        put("prompt", f"seed-{i}", text)
    put("prompt", "seed-invalid-utf8", b"\xff\xfe\xc3(\xe2\x82 \xf0\x9f")


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    return key + varint(len(payload)) + payload


def request_seeds():
    # GenerateRequest: request_id=1, model=2, text=3, token_ids=4 (TokenIds{ids=1}), sampling=5,
    # max_new_tokens=6, stop=7, stop_token_ids=8.
    put("request", "seed-text", field(3, 2, b"Hello") + field(6, 0, 16))
    put("request", "seed-tokens", field(4, 2, field(1, 2, b"".join(varint(t) for t in (2, 818, 5279)))))
    put("request", "seed-huge-max", field(3, 2, b"x") + field(6, 0, 10**12))
    put("request", "seed-many-stops", field(3, 2, b"x") + b"".join(field(7, 2, b"s") for _ in range(20)))
    put("request", "seed-negative-token", field(4, 2, field(1, 0, (1 << 64) - 5)))


def ucx_request_seeds():
    # kind (even get, odd put), region bytes, a put's data length, the 48-byte header, the data.
    magic, session = 0x44445531, bytes(range(16))

    def get(region, count, block, offsets, flags=1):
        header = struct.pack("<IIII16sQq", magic, count, flags, 0, session, 7, block)
        return bytes([0]) + struct.pack("<qQ", region, 0) + header + struct.pack(f"<{len(offsets)}q", *offsets)

    def put_req(region, length, offset, nbytes):
        header = struct.pack("<II16sQqq", magic, 0, session, 9, offset, nbytes)
        return bytes([1]) + struct.pack("<qQ", region, length) + header

    kib16 = 16 << 10
    put("ucx_request", "seed-get-adjacent", get(1 << 25, 4, kib16, [0, kib16, 5 * kib16, 6 * kib16]))
    put("ucx_request", "seed-get-last-block", get(1 << 25, 2, kib16, [(1 << 25) - kib16, 0]))
    put("ucx_request", "seed-get-past-end", get(1 << 25, 1, kib16, [(1 << 25) - kib16 + 1]))
    put("ucx_request", "seed-get-negative", get(1 << 25, 2, kib16, [0, -kib16]))
    put("ucx_request", "seed-get-too-large", get(1 << 40, 4096, kib16 + 1, [0] * 4096))
    put("ucx_request", "seed-get-short-data", get(1 << 25, 3, kib16, [0, kib16]))
    put("ucx_request", "seed-put", put_req(1 << 25, kib16, kib16, kib16))
    put("ucx_request", "seed-put-wrap", put_req(1 << 25, kib16, (1 << 63) - 8, kib16))
    put("ucx_request", "seed-put-length-mismatch", put_req(1 << 25, kib16 - 1, 0, kib16))


def http_front_seeds():
    # First byte: bit 0 the keyed front, bits 1-2 the endpoint, bit 3 "Authorization: Bearer "
    # before the rest (the header lines).
    key = b"fuzz-key-0123456789abcdef0123456789abcdef"
    put("http_front", "seed-utf8-key", bytes([0b1001]) + "café".encode())
    put("http_front", "seed-tab", bytes([0b1000]) + b"a\tb")
    put("http_front", "seed-nul", bytes([0b1011]) + b"a\x00b")
    put("http_front", "seed-del", bytes([0b1101]) + b"\x7fkey")
    put("http_front", "seed-lone-lf", bytes([0b1000]) + b"x\nX-Other: y")
    put("http_front", "seed-raw-authorization", bytes([0b0011]) + b"Authorization: \x01\x02")
    put("http_front", "seed-valid-key", bytes([0b1001]) + key)
    put("http_front", "seed-origin", bytes([0b0000]) + b"Origin: http://evil.example")
    put("http_front", "seed-long", bytes([0b1011]) + b"k" * 3000)


def registry_record_seeds():
    # First byte: bit 0 the router has the target's cluster secret, bit 1 the key has a lease;
    # the rest is the etcd value (signed: HMAC-SHA256 of the key, a newline and the record).
    import hashlib
    import hmac
    secret, key = b"fuzz-cluster-secret-0123456789abcdef", b"/dualdecoder/workers/w1"
    record = json.dumps({"workerId": "w1", "address": "127.0.0.1:1", "model": "m", "mode": "full",
                         "publishedUnixSeconds": 1.8e9,
                         "load": {"maxBatch": 4, "recentPrefixKeys": ["1", "2"]}}).encode()
    mac = hmac.new(secret, key + b"\n" + record, hashlib.sha256).hexdigest().encode()
    signed = b"hmac-sha256:" + mac + b" " + record
    put("registry_record", "seed-unsigned", bytes([2]) + record)
    put("registry_record", "seed-signed", bytes([3]) + signed)
    put("registry_record", "seed-signed-no-lease", bytes([1]) + signed)
    put("registry_record", "seed-unsigned-to-keyed", bytes([3]) + record)
    put("registry_record", "seed-bad-signature", bytes([3]) + b"hmac-sha256:" + b"0" * 64 + b" " + record)
    put("registry_record", "seed-other-key", bytes([2]) + record.replace(b'"w1"', b'"w2"'))
    put("registry_record", "seed-no-space", bytes([3]) + b"hmac-sha256:" + b"0" * 64)
    put("registry_record", "seed-not-json", bytes([2]) + b"{not json")
    # A KV pool's record (the same bytes are also read as one, at /dualdecoder/pools/p1).
    pool_key = b"/dualdecoder/pools/p1"
    pool = json.dumps({"pool_id": "p1", "address": "127.0.0.1:1", "node": "n1", "ucx": True,
                       "capacity_bytes": 1 << 30, "published_unix_seconds": 1.8e9}).encode()
    pool_mac = hmac.new(secret, pool_key + b"\n" + pool, hashlib.sha256).hexdigest().encode()
    put("registry_record", "seed-pool-unsigned", bytes([2]) + pool)
    put("registry_record", "seed-pool-signed", bytes([3]) + b"hmac-sha256:" + pool_mac + b" " + pool)


def main():
    for f in (gguf_seeds, safetensors_seeds, tokenizer_json_seeds, tenants_seeds, prompt_seeds, request_seeds,
              ucx_request_seeds, http_front_seeds, registry_record_seeds):
        f()
    n = sum(1 for _ in (HERE / "corpus").rglob("seed-*"))
    print(f"make_corpus: {n} seed files under {HERE / 'corpus'}", file=sys.stderr)


if __name__ == "__main__":
    main()
