// A layer's batch-wide attention plan: for every sequence's decode rows (a group), one key-value
// list per KV head, built key by key, then one Ops::AttendGroups call for the whole batch. The
// lists point into the plan's own storage, sized once per layer call (Begin).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "dd/backend/ops.h"

namespace dd::engine {

class AttentionPlan {
 public:
  // Room for `keys` keys in all and `groups` groups of `heads` lists and at most two rows each.
  void Begin(int64_t keys, int64_t groups, int64_t heads);
  // Appends a key-value pair (device addresses of head_dim elements of the KV type each) to the
  // open list.
  void Add(const void* k, const void* v) {
    keys_[next_] = k;
    values_[next_] = v;
    ++next_;
  }
  // Closes the open list (the next KV head's starts).
  void EndList();
  // Closes the open group: its lists since the last EndGroup, and its rows.
  void EndGroup(absl::Span<const backend::ListQuery> rows);
  void Run(backend::Ops& ops, const backend::AttentionShape& shape, float scale) const;

 private:
  std::vector<const void*> keys_, values_;
  std::vector<backend::KeyValueList> lists_;
  std::vector<backend::ListQuery> rows_;
  std::vector<backend::AttentionGroup> groups_;
  int64_t next_ = 0, list_from_ = 0;   // the next key; the open list's first
  size_t n_lists_ = 0, group_lists_ = 0, n_rows_ = 0, n_groups_ = 0;
};

}  // namespace dd::engine
