// Static segments (Ops::BeginSegment / EndSegment): the launches of a run of ops, recorded with
// every argument, and the replayable executables (CUDA graphs) kept for them. Host-only (no
// CUDA types), so the matching and eviction are tested without a device.
//
// A recorded launch holds every argument its kernel gets, so two runs of records compare equal
// exactly when their launches would be the same: an executable is replayed only for records
// equal to those it was made from, and a segment whose arguments changed (another batch size,
// another buffer) is recorded again. No key is trusted to stand for the arguments.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace dd::kernels::cuda {

// The ops a segment may hold: those that launch kernels with no host-side lists (nothing staged
// in the argument ring), so that a replay reads nothing the host wrote since.
enum class StaticOp : int64_t { kRmsNorm, kLinearInt8, kLinearF32, kHeadNormRope, kGatedMul, kAdd, kSoftcap };

// One launch and all its arguments. Fixed size with no padding, compared byte by byte.
struct StaticCall {
  StaticOp op;
  const void* p[6];
  int64_t n[8];
  float f[2];

  bool operator==(const StaticCall& o) const { return std::memcmp(this, &o, sizeof(StaticCall)) == 0; }
};
static_assert(sizeof(StaticCall) == 8 + 6 * sizeof(void*) + 8 * 8 + 2 * 4, "StaticCall has no padding");

inline StaticCall MakeStaticCall(StaticOp op) {
  StaticCall c;
  std::memset(&c, 0, sizeof(c));
  c.op = op;
  return c;
}

// Executables by key, each kept with the records it was made from; at most `per_key` per key,
// the least recently used dropped first. Exec is a handle the caller destroys (CUDA: a
// cudaGraphExec_t); the cache never destroys one itself, it hands dropped ones back.
template <typename Exec>
class SegmentCache {
 public:
  explicit SegmentCache(int per_key) : per_key_(std::max(per_key, 1)) {}

  // The executable made from records equal to `calls` under `key`, or null. A hit becomes the
  // key's most recently used. Allocates nothing.
  const Exec* Find(int64_t key, absl::Span<const StaticCall> calls) {
    const auto it = keys_.find(key);
    if (it == keys_.end()) return nullptr;
    std::vector<Entry>& list = it->second;
    for (size_t i = 0; i < list.size(); ++i) {
      if (!std::equal(list[i].calls.begin(), list[i].calls.end(), calls.begin(), calls.end())) continue;
      std::rotate(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(i), list.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      ++hits_;
      return &list.front().exec;
    }
    return nullptr;
  }

  // Keeps `exec` for `calls` under `key` as its most recently used; the executables it drops
  // (beyond per_key) are appended to *dropped for the caller to destroy.
  void Insert(int64_t key, absl::Span<const StaticCall> calls, Exec exec, std::vector<Exec>* dropped) {
    std::vector<Entry>& list = keys_[key];
    list.insert(list.begin(), Entry{std::vector<StaticCall>(calls.begin(), calls.end()), std::move(exec)});
    ++made_;
    while (static_cast<int>(list.size()) > per_key_) {
      dropped->push_back(std::move(list.back().exec));
      list.pop_back();
    }
  }

  // Every executable, for the caller to destroy; the cache is left empty.
  std::vector<Exec> Clear() {
    std::vector<Exec> all;
    for (auto& [key, list] : keys_) {
      for (Entry& e : list) all.push_back(std::move(e.exec));
    }
    keys_.clear();
    return all;
  }

  int64_t size() const {
    int64_t n = 0;
    for (const auto& [key, list] : keys_) n += static_cast<int64_t>(list.size());
    return n;
  }
  int64_t hits() const { return hits_; }
  int64_t made() const { return made_; }

 private:
  struct Entry {
    std::vector<StaticCall> calls;
    Exec exec;
  };
  int per_key_;
  std::unordered_map<int64_t, std::vector<Entry>> keys_;
  int64_t hits_ = 0, made_ = 0;
};

}  // namespace dd::kernels::cuda
