#include "decode-worker/engine/chunk_writer.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dd/backend/ops.h"

namespace dd::engine {

absl::Status ChunkWriter::Append(LayerRows& st, kvpool::SequenceId id, int64_t layer,
                                 const backend::DeviceBuffer& src_buf, const float* k, const float* v, int64_t pos,
                                 int64_t n) {
  RETURN_IF_ERROR(Prepare(st, pos, n));
  RETURN_IF_ERROR(rows_.Store(st, pos, pos + n, src_buf, k, v));
  // Host f32 rows are already the KV type's rows when it is f32.
  const bool host_kv = !src_buf && rows_.kv_dtype() == KvDtype::kF32;
  RETURN_IF_ERROR(Appended(st, id, layer, pos, n, host_kv ? k : nullptr, host_kv ? v : nullptr));
  // Rows from host memory: copied before the caller may reuse it.
  return !src_buf ? device_.Synchronize(device_.Record(backend::Queue::kCompute)) : absl::OkStatus();
}

absl::Status ChunkWriter::AppendHost(LayerRows& st, kvpool::SequenceId id, int64_t layer, const void* k, const void* v,
                                     int64_t pos, int64_t n) {
  RETURN_IF_ERROR(Prepare(st, pos, n));
  RETURN_IF_ERROR(rows_.StoreHost(st, pos, pos + n, k, v));
  RETURN_IF_ERROR(Appended(st, id, layer, pos, n, k, v));
  return device_.Synchronize(device_.Record(backend::Queue::kCompute));
}

absl::Status ChunkWriter::Prepare(LayerRows& st, int64_t pos, int64_t n) {
  if (pos != st.length) {
    return absl::InvalidArgumentError(absl::StrCat("row position ", pos, " does not continue the cache (expected ",
                                                   st.length, ")"));
  }
  // A ring row is rewritten only after the write-back copies that read it.
  if (write_back_.pending()) device_.Wait(backend::Queue::kCompute, write_back_.last_copy());
  return rows_.Ensure(st, pos + n);
}

absl::Status ChunkWriter::Appended(LayerRows& st, kvpool::SequenceId id, int64_t layer, int64_t pos, int64_t n,
                                   const void* host_k, const void* host_v) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim, C = options_.chunk_tokens;
  const int64_t c0 = st.length / C;
  st.length += n;
  const int64_t c1 = st.length / C;
  if (c1 <= c0) return absl::OkStatus();
  // Chunks full: a landmark per KV head computed where the keys are, the blocks to the store.
  RETURN_IF_ERROR(rows_.EnsureLandmarks(st, c1));
  keys_.resize((c1 - c0) * C);
  for (int64_t p = c0 * C; p < c1 * C; ++p) keys_[p - c0 * C] = rows_.K(st, p);
  device_.ops().ChunkMeans(keys_.data(), rows_.kv_dtype(), c1 - c0, C, kv_dim,
                           static_cast<float*>(st.landmarks.data) + c0 * kv_dim);
  if (host_k != nullptr && c0 * C == pos) {
    // Host rows in the KV type from a chunk's start (a restored prefix, random KV): written
    // from them now.
    return chunks_.WriteChunks(id, layer, c0, c1, host_k, host_v);
  }
  return write_back_.Start(st, id, layer, c0, c1);
}

}  // namespace dd::engine
