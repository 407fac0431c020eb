#include "decode-worker/engine/chunk_writer.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dd/backend/ops.h"

namespace dd::engine {

absl::Status ChunkWriter::Append(LayerRows& st, kvpool::SequenceId id, int64_t layer,
                                 const backend::DeviceBuffer& src_buf, const float* k, const float* v, int64_t pos,
                                 int64_t n) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim, C = options_.chunk_tokens;
  if (pos != st.length) {
    return absl::InvalidArgumentError(absl::StrCat("row position ", pos, " does not continue the cache (expected ",
                                                   st.length, ")"));
  }
  // A ring row is rewritten only after the write-back copies that read it.
  if (write_back_.pending()) device_.Wait(backend::Queue::kCompute, write_back_.last_copy());
  RETURN_IF_ERROR(rows_.Ensure(st, pos + n));
  RETURN_IF_ERROR(rows_.Store(st, pos, pos + n, src_buf, k, v));
  const int64_t c0 = st.length / C;
  st.length += n;
  const int64_t c1 = st.length / C;
  const bool host_rows = !src_buf;
  if (c1 > c0) {
    // Chunks full: a landmark per KV head computed where the keys are, the blocks to the store.
    RETURN_IF_ERROR(rows_.EnsureLandmarks(st, c1));
    keys_.resize((c1 - c0) * C);
    for (int64_t p = c0 * C; p < c1 * C; ++p) keys_[p - c0 * C] = rows_.K(st, p);
    device_.ops().ChunkMeans(keys_.data(), KvDtype::kF32, c1 - c0, C, kv_dim,
                             static_cast<float*>(st.landmarks.data) + c0 * kv_dim);
    if (host_rows && c0 * C == pos) {
      // Host rows from a chunk's start (a restored prefix, random KV): written from them now.
      RETURN_IF_ERROR(chunks_.WriteChunks(id, layer, c0, c1, k, v));
    } else {
      RETURN_IF_ERROR(write_back_.Start(st, id, layer, c0, c1));
    }
  }
  // Rows from host memory: copied before the caller may reuse it.
  return host_rows ? device_.Synchronize(device_.Record(backend::Queue::kCompute)) : absl::OkStatus();
}

}  // namespace dd::engine
