// Models of real models' shapes with random weights, written by the project as GGUF files.
//
// For measurements where the real file cannot be: a bare GPU machine that the real models cannot
// reach, and the paper's shape (Llama-3.1-8B), which is never downloaded. The file loads like
// any other model (LoadGguf) and costs what a real file of its shape and types costs per step.
// Random weights do not attend like trained ones: hit rates, selections and fidelity measured
// on them mean nothing, and every result taken on one must say it is synthetic.
//
// Contents: the weight matrices in the shape's block types (those of the real file: Q4_K
// falling back to Q5_0 where a row is not a multiple of 256, as llama.cpp's Q4_K_M does), norms
// as ones, random block bytes whose scales are set so that a matrix maps a unit-RMS input to
// about unit RMS. The tokenizer is byte-level BPE without merges (one token per byte), padded
// with unused tokens to the shape's vocabulary.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dd/kernels/dtype.h"

namespace dd::model {

struct SyntheticShape {
  std::string name;           // as SyntheticShapeNamed knows it, e.g. "llama-3.1-8b"
  std::string arch;           // "llama" or "gemma3"
  int64_t n_layer = 0, n_embd = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0;
  int64_t n_vocab = 0, n_ctx = 0;
  double rope_base = 10000.0;
  double norm_eps = 1e-5;
  bool tied = false;          // no output.weight: the embedding is the head
  int64_t sliding_window = 0; // gemma3: every 6th layer global, the others this window
  bool llama3_rope = false;   // rope_freqs.weight with Llama-3.1's scaling (factor 8 over 8192)
  // Block types (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1 or Q5_0): the layers' matrices, the type for a
  // matrix whose rows do not hold whole blocks of `matrices`, the embedding, the output head.
  kernels::DType matrices = kernels::DType::kQ4_K;
  kernels::DType fallback = kernels::DType::kQ5_0;
  kernels::DType embedding = kernels::DType::kQ4_K;
  kernels::DType output = kernels::DType::kQ6_K;
};

// The shapes known by name: llama-3.1-8b, gemma3-270m, smollm2-135m (the real models'
// hyper-parameters, from their files).
std::vector<std::string> SyntheticShapeNames();
// InvalidArgument naming the known shapes for any other name.
absl::StatusOr<SyntheticShape> SyntheticShapeNamed(absl::string_view name);

struct SyntheticOptions {
  uint64_t seed = 1;
  // Called after each tensor with the bytes written so far and the file's total.
  std::function<void(int64_t written, int64_t total)> progress{};
};

// The file's size in bytes (header and padding included).
absl::StatusOr<int64_t> SyntheticGgufBytes(const SyntheticShape& shape, const SyntheticOptions& options);

// Writes the model to `path` through a temporary file beside it (`path`.tmp.<pid>),
// and renamed when complete: a file under `path` is always whole. The same shape, options and seed give the same bytes. InvalidArgument for a
// shape that fails ModelConfig's checks or an unsupported type; the I/O error otherwise.
absl::Status WriteSyntheticGguf(const SyntheticShape& shape, const SyntheticOptions& options, const std::string& path);

}  // namespace dd::model
