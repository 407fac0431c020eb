// The GPU's quantized matrix-vector product for decode
// (docs/decisions/0034-gpu-kernels-groundwork.md), first type: Q4_K weights read in their GGUF
// blocks, activations quantized per row to int8 blocks of 32 exactly as the CPU's
// QuantizeRowInt8Blocks does (bit for bit), integer dot products, f32 scale products.
// Batch invariant by construction: each activation row is reduced by the same lanes in the same
// order whatever the number of rows, and rows are processed in fixed groups of kMatVecRows, so a
// row's output never depends on its batch-mates (tested bitwise on the device).
// Internal to kernels/cuda (names CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dd::kernels::cuda {

constexpr int kMatVecRows = 8;  // activation rows per pass over the weights

// x: rows x k f32 (device, row stride k), k a multiple of 32. Writes q (rows x k int8), d (rows x
// k/32 scales) and qsum (rows x k/32, the sum of each block's q, for Q4_K's min term).
cudaError_t QuantizeRowsInt8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d,
                             int32_t* qsum, cudaStream_t stream);

// y[r][i] = sum_j W[i][j] * xq[r][j] for r < rows, i < n; W is n rows of k/256 Q4_K blocks
// (144 bytes each), k a multiple of 256; y has row stride n. All pointers on the device; w and q
// 16-byte aligned, d and qsum 8-byte aligned (as cudaMalloc gives).
cudaError_t MatVecQ4K(const uint8_t* w, int64_t n, int64_t k, const int8_t* q, const float* d,
                      const int32_t* qsum, int64_t rows, float* y, cudaStream_t stream);

// The same product with a chosen number of outputs (weight rows) per warp, 1, 2 or 4: warps that
// compute several outputs read each activation row once for all of them. Every variant gives the
// same bits (each output's operations are the same); MatVecQ4K uses 2 below 4 activation rows
// and 4 from there (the fastest measured on an H200). For the tests and the benchmark.
cudaError_t MatVecQ4KVariant(int outputs_per_warp, const uint8_t* w, int64_t n, int64_t k, const int8_t* q,
                             const float* d, const int32_t* qsum, int64_t rows, float* y, cudaStream_t stream);

}  // namespace dd::kernels::cuda
