#include "decode-worker/engine/sparse_kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "decode-worker/engine/attention_ops.h"
#include "decode-worker/engine/kv_block.h"
#include "decode-worker/engine/random_kv.h"

namespace dd::engine {
void SparseKvCache::SkipWaitForTesting(SkipWait skip) {
  ChunkStore::SkipComputeWaitForTesting(skip == SkipWait::kComputeWaitsForLanding);
}

SparseKvCache::SparseKvCache(const model::ModelConfig& config, const SparseOptions& options, KvDtype kv,
                             kvpool::KvStore* store, backend::Device& device)
    : config_(config), options_(options), device_(device),
      chunks_(config, options.chunk_tokens, store, device, /*device_gathers=*/true, kv),
      stats_(config.n_layer), rows_(config, options_, device, kv),
      selector_(config, options_, device), writer_(config, options_, device, rows_, chunks_),
      fetch_(MakeFetchPolicy({config, options_, device, chunks_, stats_})),
      recon_(options_.key_reconstruction, config.n_layer), low_rank_(config, options_, device, rows_) {
  map_.index.assign(config.n_layer, -1);
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const auto& only = options.sparse_layers;
    if (!config.layer_is_swa[l] && (only.none() || (l < SparseOptions::kMaxLayers && only.test(l)))) {
      map_.index[l] = static_cast<int64_t>(map_.layers.size());
      map_.layers.push_back(l);
    }
  }
}

absl::StatusOr<std::unique_ptr<SparseKvCache>> SparseKvCache::Create(const model::ModelConfig& config,
                                                                     const SparseOptions& options, KvDtype kv,
                                                                     kvpool::KvStore* store, backend::Device& device) {
  RETURN_IF_ERROR(options.Validate(config));
  if (options.spec_candidates == SparseOptions::kAutoSpecCandidates) {
    return absl::InvalidArgumentError("sparse KV options: speculative candidates unresolved (-1 = by the speculative "
                                      "head; Engine::Normalized resolves them)");
  }
  if (store == nullptr) return absl::InvalidArgumentError("sparse mode needs a KV store");
  return std::unique_ptr<SparseKvCache>(new SparseKvCache(config, options, kv, store, device));
}

SparseKvCache::~SparseKvCache() {
  writer_.Discard();  // the copies waited for; the store is not written any more
  for (size_t i = 0; i < seqs_.size(); ++i) {
    if (seqs_[i].open) fetch_->WaitAll(static_cast<int32_t>(i));
  }
  // Nothing queued may still use the buffers (or the landmark scratch) when they go.
  (void)device_.Synchronize(device_.Record(backend::Queue::kCompute));
  for (size_t i = 0; i < seqs_.size(); ++i) FreeSeq(static_cast<int32_t>(i));
}

absl::StatusOr<SparseKvCache::Seq*> SparseKvCache::GetSeq(int32_t seq) {
  if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("negative sequence slot ", seq));
  if (seq >= static_cast<int32_t>(seqs_.size())) seqs_.resize(seq + 1);
  Seq& s = seqs_[seq];
  if (!s.open) {
    ASSIGN_OR_RETURN(s.store_id, chunks_.Open());
    s.open = true;
    s.layers.assign(config_.n_layer, LayerRows());
    s.draws.assign(config_.n_layer, ModelDraw());
    if (recon_.enabled()) s.low_rank.assign(config_.n_layer, LowRankLayer());
  }
  return &s;
}

void SparseKvCache::FreeSeq(int32_t seq) {
  Seq& s = seqs_[seq];
  for (LayerRows& st : s.layers) rows_.Free(st);
  for (LowRankLayer& lr : s.low_rank) low_rank_.Free(lr);
  device_.Free(s.scores.buf);
  device_.Free(s.own);
  fetch_->Release(seq);
}

absl::StatusOr<kvpool::SequenceId> SparseKvCache::StoreSequence(int32_t seq) {
  ASSIGN_OR_RETURN(const Seq* s, GetSeq(seq));
  return s->store_id;
}

void SparseKvCache::Reset(int32_t seq) {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return;
  if (seqs_[seq].open) {
    // The chunks still on their way, every slot's: none may still read the rows about to go.
    if (absl::Status st = writer_.Flush(); !st.ok()) LOG(WARNING) << "KV write-back failed: " << st;
    fetch_->WaitAll(seq);  // no transfer may still write into buffers about to be freed
    (void)device_.Synchronize(device_.Record(backend::Queue::kCompute));  // nor queued work read them
    FreeSeq(seq);
    chunks_.Release(seqs_[seq].store_id);
  }
  seqs_[seq] = Seq();
}

double SparseKvCache::SeqHitRate(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return 0.0;
  return seqs_[seq].counts.hit_rate();
}

SparseKvCache::SeqKvBytes SparseKvCache::SeqTransfers(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return {};
  const SeqKvCounts& c = seqs_[seq].counts;
  return {MovedBytes(c.prefetched, c.prefetched_values, block_bytes()),
          MovedBytes(c.urgent, c.urgent_values, block_bytes()), MovedBytes(c.wasted, c.wasted_values, block_bytes())};
}

SparseKvCache::SeqAuxBytes SparseKvCache::SeqAuxiliary(int32_t seq) const {
  SeqAuxBytes b;
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return b;
  for (const LayerRows& st : seqs_[seq].layers) b.landmarks += st.landmarks.bytes;
  for (const LowRankLayer& lr : seqs_[seq].low_rank) b.low_rank_keys += LowRankKeyCache::bytes(lr);
  return b;
}

int64_t SparseKvCache::Length(int32_t seq) const {
  int64_t n = 0;
  if (seq >= 0 && seq < static_cast<int32_t>(seqs_.size())) {
    for (const LayerRows& st : seqs_[seq].layers) n = std::max(n, st.length);
  }
  return n;
}

int64_t SparseKvCache::device_bytes() const {
  int64_t total = fetch_->device_bytes();
  for (const Seq& s : seqs_) {
    for (const LayerRows& st : s.layers) total += rows_.bytes(st);
    for (const LowRankLayer& lr : s.low_rank) total += LowRankKeyCache::bytes(lr);
    total += s.scores.buf.bytes;
  }
  return total;
}

absl::Status SparseKvCache::Copy(int32_t src, int32_t dst) {
  if (src == dst) return absl::OkStatus();
  Reset(dst);
  RETURN_IF_ERROR(writer_.Flush());  // every block of `src` in the store before the copy
  ASSIGN_OR_RETURN(Seq * from, GetSeq(src));
  fetch_->WaitAll(src);
  ASSIGN_OR_RETURN(Seq * to, GetSeq(dst));  // `from` stays valid (a deque)
  // The bookkeeping as it is; every device buffer duplicated (none shared).
  Seq copy = *from;
  for (LayerRows& st : copy.layers) st.sink_k = st.sink_v = st.k = st.v = st.landmarks = backend::DeviceBuffer{};
  for (LowRankLayer& lr : copy.low_rank) lr.basis = lr.coeffs = backend::DeviceBuffer{};
  copy.scores.buf = copy.own = backend::DeviceBuffer{};
  copy.store_id = to->store_id;
  *to = std::move(copy);
  absl::Status dup;
  for (int64_t l = 0; l < config_.n_layer && dup.ok(); ++l) dup = rows_.Duplicate(from->layers[l], to->layers[l]);
  for (size_t l = 0; l < from->low_rank.size() && dup.ok(); ++l) {
    dup = low_rank_.Duplicate(from->low_rank[l], to->low_rank[l]);
  }
  // Scratch: the size, not the contents.
  if (dup.ok()) dup = DuplicateBuffer(device_, from->scores.buf, /*contents=*/false, &to->scores.buf);
  if (dup.ok()) dup = DuplicateBuffer(device_, from->own, /*contents=*/false, &to->own);
  if (dup.ok()) dup = fetch_->Copy(src, dst);
  if (!dup.ok()) {
    Reset(dst);
    return dup;
  }
  // The offloaded blocks, duplicated under the new store sequence.
  std::vector<int64_t> chunks(config_.n_layer);
  for (int64_t l = 0; l < config_.n_layer; ++l) chunks[l] = from->layers[l].length / options_.chunk_tokens;
  return chunks_.CopyBlocks(from->store_id, to->store_id, chunks);
}

absl::Status SparseKvCache::Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) {
  if (seq < 0 || prompt_tokens <= 0 || total_tokens < prompt_tokens || pass_rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("sparse KV reservation: slot ", seq, ", ", prompt_tokens,
                                                   " prompt tokens, ", total_tokens, " in all, passes of ", pass_rows));
  }
  if (Length(seq) != 0 || (seq < static_cast<int32_t>(seqs_.size()) && seqs_[seq].reserved)) {
    return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is in use"));
  }
  auto s = GetSeq(seq);
  if (!s.ok()) return s.status();
  (*s)->reserved = true;
  (*s)->total = total_tokens;
  absl::Status status;
  for (int64_t l : map_.layers) {
    if (status.ok()) status = rows_.Reserve((*s)->layers[l], prompt_tokens, total_tokens);
    if (status.ok() && options_.key_reconstruction.MayReconstruct(l)) {
      status = low_rank_.Reserve((*s)->low_rank[l], total_tokens);
    }
  }
  if (status.ok()) status = selector_.EnsureScores((*s)->scores, total_tokens);
  if (status.ok()) status = EnsureOwnRows(**s);
  if (status.ok()) status = fetch_->Reserve(seq, map_.layers);
  if (!status.ok()) Reset(seq);
  return status;
}

absl::Status SparseKvCache::EnsureOwnRows(Seq& s) {
  if (chunks_.kv_dtype() == KvDtype::kF32 || s.own) return absl::OkStatus();
  ASSIGN_OR_RETURN(s.own, device_.Allocate(backend::MemoryTag::kWorkspace, 2 * rows_.RowBytes()));
  return absl::OkStatus();
}

absl::Status SparseKvCache::FinishPrefill(int32_t seq) {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size()) || !seqs_[seq].open) return absl::OkStatus();
  Seq& s = seqs_[seq];
  for (int64_t l : map_.layers) {
    if (s.layers[l].length == 0) continue;
    RETURN_IF_ERROR(BuildLowRank(s, l));
    RETURN_IF_ERROR(rows_.StartDecoding(s.layers[l], s.reserved ? s.total : 0));
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::BuildLowRank(Seq& s, int64_t layer) {
  if (s.low_rank.empty() || s.layers[layer].decoded || !options_.key_reconstruction.MayReconstruct(layer)) {
    return absl::OkStatus();
  }
  return low_rank_.Build(s.low_rank[layer], s.layers[layer]);
}

absl::Status SparseKvCache::RestorePrefix(int32_t seq, kvpool::SequenceId handle, int64_t tokens) {
  const int64_t C = options_.chunk_tokens;
  if (tokens <= 0 || tokens % C != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix of ", tokens, " tokens is not a positive multiple of ", C));
  }
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  ASSIGN_OR_RETURN(Seq * s, GetSeq(seq));
  const int64_t chunks = tokens / C, batch = 64;  // chunks per gather
  KvRows k, v;
  for (int64_t l : map_.layers) {
    for (int64_t c0 = 0; c0 < chunks; c0 += batch) {
      const int64_t c1 = std::min(chunks, c0 + batch);
      RETURN_IF_ERROR(chunks_.ReadRows(handle, l, c0, c1, &k, &v));
      // Device rows, landmarks and the slot's own blocks, as in prefill.
      RETURN_IF_ERROR(writer_.AppendHost(s->layers[l], s->store_id, l, k.data(), v.data(), c0 * C, (c1 - c0) * C));
    }
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::FillRandom(int32_t seq, int64_t tokens, uint64_t seed) {
  if (tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("random KV of ", tokens, " tokens"));
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  ASSIGN_OR_RETURN(Seq * s, GetSeq(seq));
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim, C = options_.chunk_tokens;
  const RandomKv rows(seed, kv_dim);
  // Pieces of about 4 MiB of keys, whole chunks: each goes through ChunkWriter::Append as a prefill's
  // rows do (device rows, landmarks, blocks to the store).
  const int64_t piece = std::max<int64_t>(1, (int64_t{1} << 20) / kv_dim / C) * C;
  std::vector<float> k, v;
  for (int64_t l : map_.layers) {
    for (int64_t p0 = 0; p0 < tokens; p0 += piece) {
      const int64_t p1 = std::min(tokens, p0 + piece);
      k.resize((p1 - p0) * kv_dim);
      v.resize(k.size());
      rows.Rows(l, /*values=*/false, p0, p1, k.data());
      rows.Rows(l, /*values=*/true, p0, p1, v.data());
      const KvDtype t = chunks_.kv_dtype();
      const KvRows kr = NarrowRows(k.data(), static_cast<int64_t>(k.size()), t);
      const KvRows vr = NarrowRows(v.data(), static_cast<int64_t>(v.size()), t);
      RETURN_IF_ERROR(writer_.AppendHost(s->layers[l], s->store_id, l, kr.data(), vr.data(), p0, p1 - p0));
    }
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
