// Device-side readers of the GGUF block formats, shared by the CUDA kernels: one element
// dequantized (the CPU's formulas in kernels/cpu/dequant.cc, without contraction into fma), and
// one 32-element block as signed integer codes with its factors (the CPU's DecodeRow in
// kernels/cpu/matmul_int8_rows.cc). Layouts as documented for ggml's block types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_kernels.h"

namespace dd::kernels::cuda {

__device__ inline float H2F(const uint8_t* p) {
  __half_raw r;
  r.x = static_cast<unsigned short>(p[0] | (p[1] << 8));
  return __half2float(__half(r));
}

__device__ inline void ScaleMinK(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

__host__ __device__ inline int64_t BlockBytesOf(DType t) {
  switch (t) {
    case DType::kQ8_0: return 34;
    case DType::kQ4_0: return 18;
    case DType::kQ4_1: return 20;
    case DType::kQ5_0: return 22;
    case DType::kQ5_1: return 24;
    case DType::kQ4_K: return 144;
    case DType::kQ5_K: return 176;
    case DType::kQ6_K: return 210;
    default: return 0;
  }
}

// Element j of a row of type t at `row`.
__device__ inline float DequantElem(DType t, const uint8_t* row, int64_t j) {
  switch (t) {
    case DType::kF32: return reinterpret_cast<const float*>(row)[j];
    case DType::kF16: return H2F(row + 2 * j);
    case DType::kBF16: {
      const uint32_t bits = static_cast<uint32_t>(row[2 * j] | (row[2 * j + 1] << 8)) << 16;
      return __uint_as_float(bits);
    }
    case DType::kQ8_0: {
      const uint8_t* b = row + (j / 32) * 34;
      return __fmul_rn(H2F(b), static_cast<float>(static_cast<int8_t>(b[2 + j % 32])));
    }
    case DType::kQ4_0:
    case DType::kQ4_1: {
      const bool has_min = t == DType::kQ4_1;
      const uint8_t* b = row + (j / 32) * (has_min ? 20 : 18);
      const int i = static_cast<int>(j % 32);
      const uint8_t byte = b[(has_min ? 4 : 2) + (i % 16)];
      const int q = i < 16 ? (byte & 0x0f) : (byte >> 4);
      if (has_min) return __fadd_rn(__fmul_rn(H2F(b), static_cast<float>(q)), H2F(b + 2));
      return __fmul_rn(H2F(b), static_cast<float>(q - 8));
    }
    case DType::kQ5_0:
    case DType::kQ5_1: {
      const bool has_min = t == DType::kQ5_1;
      const int head = has_min ? 8 : 6;
      const uint8_t* b = row + (j / 32) * (head + 16);
      const int i = static_cast<int>(j % 32);
      const uint32_t qh = static_cast<uint32_t>(b[head - 4]) | (static_cast<uint32_t>(b[head - 3]) << 8) |
                          (static_cast<uint32_t>(b[head - 2]) << 16) | (static_cast<uint32_t>(b[head - 1]) << 24);
      const uint8_t byte = b[head + (i % 16)];
      const int q = (i < 16 ? (byte & 0x0f) : (byte >> 4)) | (((qh >> i) & 1) << 4);
      if (has_min) return __fadd_rn(__fmul_rn(H2F(b), static_cast<float>(q)), H2F(b + 2));
      return __fmul_rn(H2F(b), static_cast<float>(q - 16));
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool five = t == DType::kQ5_K;
      const uint8_t* b = row + (j / 256) * (five ? 176 : 144);
      const int i = static_cast<int>(j % 256), sub = i / 32, l = i % 32;
      int sc, m;
      ScaleMinK(sub, b + 4, &sc, &m);
      const float d = __fmul_rn(H2F(b), static_cast<float>(sc)), mn = __fmul_rn(H2F(b + 2), static_cast<float>(m));
      const uint8_t* ql = b + (five ? 48 : 16) + 32 * (sub / 2);
      int q = (ql[l] >> (4 * (sub % 2))) & 0x0f;
      if (five) q |= ((b[16 + l] >> sub) & 1) << 4;
      return __fsub_rn(__fmul_rn(d, static_cast<float>(q)), mn);
    }
    case DType::kQ6_K: {
      const uint8_t* b = row + (j / 256) * 210;
      const int i = static_cast<int>(j % 256), h = i / 128, quarter = (i % 128) / 32, l = i % 32;
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      const int low = quarter % 2 == 0 ? ql[l] : ql[l + 32];
      const int q = ((quarter < 2 ? (low & 0x0f) : (low >> 4)) | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
      const int8_t sc = static_cast<int8_t>(b[192 + 8 * h + l / 16 + 2 * quarter]);
      return __fmul_rn(__fmul_rn(H2F(b + 208), static_cast<float>(sc)), static_cast<float>(q));
    }
    default: return 0.0f;
  }
}

// One 32-element block of a row as signed codes (each fits int8) packed four per word —
// w[0..3] elements 0..15, w[4..7] elements 16..31 — with DecodeRow's factors: scale, minscale
// and, for Q6_K, the two 16-element scales.
struct CodeBlock {
  int32_t w[8];
  float scale, minscale;
  int32_t sc_lo, sc_hi;
};

__device__ inline int32_t Pack4(int a, int b, int c, int d) {
  return static_cast<int32_t>((static_cast<uint32_t>(a) & 0xff) | ((static_cast<uint32_t>(b) & 0xff) << 8) |
                              ((static_cast<uint32_t>(c) & 0xff) << 16) | ((static_cast<uint32_t>(d) & 0xff) << 24));
}

// Block `bi` (of 32 elements) of a row of type t.
__device__ inline CodeBlock DecodeBlock(DType t, const uint8_t* row, int64_t bi) {
  CodeBlock out;
  out.minscale = 0.0f;
  out.sc_lo = out.sc_hi = 1;
  int c[32];
  switch (t) {
    case DType::kQ8_0: {
      const uint8_t* b = row + bi * 34;
      out.scale = H2F(b);
      for (int i = 0; i < 32; ++i) c[i] = static_cast<int8_t>(b[2 + i]);
      break;
    }
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1: {
      const bool has_min = t == DType::kQ4_1 || t == DType::kQ5_1;
      const bool five = t == DType::kQ5_0 || t == DType::kQ5_1;
      const int head = 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
      const int zp = five ? (has_min ? 0 : 16) : (has_min ? 0 : 8);
      const uint8_t* b = row + bi * (head + 16);
      out.scale = H2F(b);
      if (has_min) out.minscale = H2F(b + 2);
      uint32_t qh = 0;
      if (five) {
        qh = static_cast<uint32_t>(b[head - 4]) | (static_cast<uint32_t>(b[head - 3]) << 8) |
             (static_cast<uint32_t>(b[head - 2]) << 16) | (static_cast<uint32_t>(b[head - 1]) << 24);
      }
      for (int j = 0; j < 16; ++j) {
        c[j] = ((b[head + j] & 0x0f) | (((qh >> j) & 1) << 4)) - zp;
        c[16 + j] = ((b[head + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - zp;
      }
      break;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool five = t == DType::kQ5_K;
      const uint8_t* b = row + (bi / 8) * (five ? 176 : 144);
      const int j = static_cast<int>(bi % 8);
      int sc, m;
      ScaleMinK(j, b + 4, &sc, &m);
      out.scale = H2F(b) * static_cast<float>(sc);
      out.minscale = -(H2F(b + 2) * static_cast<float>(m));
      const uint8_t* qg = b + (five ? 48 : 16) + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        c[l] = (qg[l] >> shift) & 0x0f;
        if (five) c[l] |= ((b[16 + l] >> j) & 1) << 4;
      }
      break;
    }
    case DType::kQ6_K: {
      const uint8_t* b = row + (bi / 8) * 210;
      const int j = static_cast<int>(bi % 8), h = j / 4, quarter = j % 4;
      out.scale = H2F(b + 208);
      out.sc_lo = static_cast<int8_t>(b[192 + 2 * j]);
      out.sc_hi = static_cast<int8_t>(b[192 + 2 * j + 1]);
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        const int low = quarter % 2 == 0 ? ql[l] : ql[l + 32];
        c[l] = ((quarter < 2 ? (low & 0x0f) : (low >> 4)) | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32;
      }
      break;
    }
    default:
      out.scale = 0.0f;
      for (int i = 0; i < 32; ++i) c[i] = 0;
      break;
  }
  for (int i = 0; i < 8; ++i) out.w[i] = Pack4(c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]);
  return out;
}

}  // namespace dd::kernels::cuda
