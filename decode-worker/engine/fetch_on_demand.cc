// The on-demand fetch strategy (`sparse`): every read gathers its whole selection on the
// urgent path into the sequence's urgent blocks (budget blocks per KV head); nothing is kept
// across steps and nothing is predicted.
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/fetch_policy.h"
#include "decode-worker/engine/sparse_rows.h"

namespace dd::engine {
namespace {

class OnDemandFetch final : public FetchPolicy {
 public:
  explicit OnDemandFetch(const FetchContext& ctx) : ctx_(ctx) {}
  ~OnDemandFetch() override {
    for (backend::DeviceBuffer& b : urgent_) ctx_.device.Free(b);
  }

  absl::Status Reserve(int32_t slot, absl::Span<const int64_t>) override { return Ensure(slot).status(); }

  absl::Status Start(const FetchSeq& s, int64_t layer, bool, DecodeRead& r) override {
    if (r.spec_row >= 0) {
      return absl::FailedPreconditionError(
          "the on-demand KV fetch predicts nothing: speculative rows need the resident fetch (dualdecoder)");
    }
    ASSIGN_OR_RETURN(const backend::DeviceBuffer* blocks, Ensure(s.slot));
    std::vector<kvpool::ChunkRef> refs;
    std::vector<ChunkStore::BlockDst> dsts;
    const Selection& sel = r.pick.sel;
    const int64_t block_bytes = ctx_.chunks.block_bytes();
    for (size_t g = 0; g < sel.size(); ++g) {
      for (int64_t c : sel[g]) {
        dsts.push_back({*blocks, static_cast<int64_t>(refs.size()) * block_bytes});
        refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), c});
      }
    }
    if (static_cast<int64_t>(refs.size()) > ctx_.budget_blocks()) {
      return absl::InternalError(
          absl::StrCat("a gather of ", refs.size(), " blocks exceeds the budget's ", ctx_.budget_blocks()));
    }
    return ctx_.chunks.StartLanding(s.store_id, refs, std::move(dsts), kvpool::Priority::kUrgent, &r.fetch.urgent,
                                    s.part());
  }

  absl::Status Finish(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) override {
    RETURN_IF_ERROR(ctx_.chunks.FinishLanding(r.fetch.urgent, backend::Queue::kUrgent));
    const uint8_t* base = static_cast<const uint8_t*>(urgent_[s.slot].data);
    const int64_t block_bytes = ctx_.chunks.block_bytes();
    r.fetch.blocks.clear();
    r.fetch.rebuild.clear();  // every block's keys, when rebuilt
    int64_t n = 0;
    for (const auto& v : r.pick.sel) n += static_cast<int64_t>(v.size());
    for (int64_t i = 0; i < n; ++i) r.fetch.blocks.push_back(base + i * block_bytes);
    if (real) ctx_.stats.Urgent(*s.counts, layer, n, s.values_only);
    return absl::OkStatus();
  }

  absl::Status Prefetch(const FetchSeq&, int64_t, Selection, bool) override {
    return absl::FailedPreconditionError("the on-demand KV fetch has no prefetch");
  }

  void WaitAll(int32_t) override {}  // every landing is waited within its attention call
  void Release(int32_t slot) override {
    if (slot >= 0 && slot < static_cast<int32_t>(urgent_.size())) ctx_.device.Free(urgent_[slot]);
  }
  absl::Status Copy(int32_t src, int32_t dst) override {  // scratch: the size, not the contents
    Grow(std::max(src, dst));
    return DuplicateBuffer(ctx_.device, urgent_[src], /*contents=*/false, &urgent_[dst]);
  }
  int64_t device_bytes() const override {
    int64_t n = 0;
    for (const backend::DeviceBuffer& b : urgent_) n += b.bytes;
    return n;
  }

 private:
  void Grow(int32_t slot) {
    if (slot >= static_cast<int32_t>(urgent_.size())) urgent_.resize(slot + 1);
  }
  absl::StatusOr<const backend::DeviceBuffer*> Ensure(int32_t slot) {
    Grow(slot);
    backend::DeviceBuffer& b = urgent_[slot];
    if (!b) {
      ASSIGN_OR_RETURN(b, AllocateOrEmpty(ctx_.device, backend::MemoryTag::kWorkspace,
                                          ctx_.budget_blocks() * ctx_.chunks.block_bytes()));
    }
    return &b;
  }

  FetchContext ctx_;
  std::vector<backend::DeviceBuffer> urgent_;  // per slot: one selection's blocks
};

}  // namespace

std::unique_ptr<FetchPolicy> NewOnDemandFetch(const FetchContext& ctx) { return std::make_unique<OnDemandFetch>(ctx); }

}  // namespace dd::engine
