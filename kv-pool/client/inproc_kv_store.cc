#include <cstring>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {
namespace {

class InProcessKvStore : public KvStore {
 public:
  absl::StatusOr<SequenceId> Open(const KvLayout& layout) override {
    if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 || layout.chunk_tokens <= 0) {
      return absl::InvalidArgumentError("KvStore::Open: layout fields must be positive");
    }
    absl::MutexLock lock(&mu_);
    const SequenceId id = ++next_id_;
    seqs_[id].layout = layout;
    return id;
  }

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const float* block) override {
    absl::MutexLock lock(&mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    Seq& s = it->second;
    if (absl::Status st = Check(s.layout, ref); !st.ok()) return st;
    std::vector<float>& b = s.blocks[Key(s.layout, ref)];
    if (b.empty()) bytes_ += s.layout.block_floats() * sizeof(float);
    b.assign(block, block + s.layout.block_floats());
    return absl::OkStatus();
  }

  absl::StatusOr<TransferId> Gather(SequenceId seq, absl::Span<const ChunkRef> refs, float* dst,
                                    Priority) override {
    absl::MutexLock lock(&mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    const Seq& s = it->second;
    const int64_t bf = s.layout.block_floats();
    for (size_t i = 0; i < refs.size(); ++i) {
      if (absl::Status st = Check(s.layout, refs[i]); !st.ok()) return st;
      auto b = s.blocks.find(Key(s.layout, refs[i]));
      if (b == s.blocks.end()) {
        return absl::NotFoundError(absl::StrCat("KvStore: chunk ", refs[i].chunk, " of layer ", refs[i].layer,
                                                " head ", refs[i].kv_head, " was never written"));
      }
      std::memcpy(dst + i * bf, b->second.data(), bf * sizeof(float));
    }
    return ++next_transfer_;
  }

  absl::Status Wait(TransferId) override { return absl::OkStatus(); }

  absl::Status Release(SequenceId seq) override {
    absl::MutexLock lock(&mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    bytes_ -= static_cast<int64_t>(it->second.blocks.size()) * it->second.layout.block_floats() * sizeof(float);
    seqs_.erase(it);
    return absl::OkStatus();
  }

  int64_t bytes_stored() const override {
    absl::MutexLock lock(&mu_);
    return bytes_;
  }

 private:
  struct Seq {
    KvLayout layout;
    std::unordered_map<int64_t, std::vector<float>> blocks;
  };
  static absl::Status Check(const KvLayout& l, const ChunkRef& r) {
    if (r.layer < 0 || r.layer >= l.n_layers || r.kv_head < 0 || r.kv_head >= l.n_kv_heads || r.chunk < 0 ||
        r.chunk >= (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat("KvStore: chunk ref (layer ", r.layer, ", head ", r.kv_head,
                                                     ", chunk ", r.chunk, ") outside the layout"));
    }
    return absl::OkStatus();
  }
  static int64_t Key(const KvLayout& l, const ChunkRef& r) {
    return (r.chunk * l.n_layers + r.layer) * l.n_kv_heads + r.kv_head;
  }

  mutable absl::Mutex mu_;
  std::unordered_map<SequenceId, Seq> seqs_;
  SequenceId next_id_ = 0;
  TransferId next_transfer_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<KvStore> NewInProcessKvStore() { return std::make_unique<InProcessKvStore>(); }

}  // namespace dd::kvpool
