#include "decode-worker/engine/chunk_writer.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::engine {

absl::Status ChunkWriter::Append(LayerRows& st, kvpool::SequenceId id, int64_t layer,
                                 const backend::DeviceBuffer& src_buf, const float* k, const float* v, int64_t pos,
                                 int64_t n) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim, C = options_.chunk_tokens;
  if (pos != st.length) {
    return absl::InvalidArgumentError(absl::StrCat("row position ", pos, " does not continue the cache (expected ",
                                                   st.length, ")"));
  }
  RETURN_IF_ERROR(rows_.Ensure(st, pos + n));
  RETURN_IF_ERROR(rows_.Store(st, pos, pos + n, src_buf, k, v));
  const int64_t c0 = st.length / C;
  st.length += n;
  const int64_t c1 = st.length / C;
  if (c1 == c0) {
    // Rows from host memory: copied before the caller may reuse it.
    return src_buf ? absl::OkStatus() : device_.Synchronize(device_.Record(backend::Queue::kCompute));
  }
  // Chunks full: their rows on the host, a landmark per KV head, one [K | V] block per KV head
  // offloaded.
  RETURN_IF_ERROR(rows_.EnsureLandmarks(st, c1));
  const int64_t rows = (c1 - c0) * C;
  // The chunks' rows on the host: the caller's, when they are host rows starting at a chunk
  // (a restored prefix, random KV), else copied back from the device.
  const float *hk = k, *hv = v;
  if (src_buf || c0 * C != pos) {
    k_.resize(rows * kv_dim);
    v_.resize(rows * kv_dim);
    RETURN_IF_ERROR(rows_.ToHost(st, c0 * C, c1 * C, k_.data(), v_.data()));
    hk = k_.data(), hv = v_.data();
  }
  // Also the last upload from landmarks_ (same queue), and the rows' copy from host memory,
  // are done after this.
  RETURN_IF_ERROR(device_.Synchronize(device_.Record(backend::Queue::kCompute)));
  landmarks_.resize((c1 - c0) * kv_dim);
  RETURN_IF_ERROR(chunks_.WriteChunks(id, layer, c0, c1, hk, hv, landmarks_.data()));
  // landmarks_ stays unchanged until the next sync of the compute queue (above, or the sparse
  // cache's Reset and destructor).
  const int64_t per_chunk = kv_dim * static_cast<int64_t>(sizeof(float));
  return device_.CopyToDevice(backend::Queue::kCompute, landmarks_.data(), st.landmarks, c0 * per_chunk,
                              (c1 - c0) * per_chunk);
}

absl::Status ChunkWriter::OffloadSliding(DenseKvCache& dense, const model::AttentionCall& call,
                                         absl::FunctionRef<absl::StatusOr<kvpool::SequenceId>(int32_t)> store_of) {
  const int64_t C = options_.chunk_tokens, kv_dim = config_.n_head_kv * config_.head_dim;
  k_.resize(C * kv_dim);
  v_.resize(C * kv_dim);
  for (const model::BatchRow& row : call.rows) {
    if (row.speculative || (row.pos + 1) % C != 0) continue;
    ASSIGN_OR_RETURN(const kvpool::SequenceId id, store_of(row.seq));
    const int64_t c = (row.pos + 1) / C - 1;
    // The ring holds the chunk's first row, hence the rest (a chunk is shorter than the window).
    if (absl::Status st = dense.ReadRows(row.seq, call.layer, c * C, (c + 1) * C, k_.data(), v_.data()); !st.ok()) {
      return absl::InternalError(absl::StrCat("sliding chunk left the ring before its offload: ", st.message()));
    }
    RETURN_IF_ERROR(chunks_.WriteChunks(id, call.layer, c, c + 1, k_.data(), v_.data(), nullptr));
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
