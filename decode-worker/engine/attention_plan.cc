#include "decode-worker/engine/attention_plan.h"

namespace dd::engine {

void AttentionPlan::Begin(int64_t keys, int64_t groups, int64_t heads) {
  keys_.resize(keys);
  values_.resize(keys);
  lists_.resize(groups * heads);
  rows_.resize(2 * groups);
  groups_.resize(groups);
  next_ = list_from_ = 0;
  n_lists_ = group_lists_ = n_rows_ = n_groups_ = 0;
}

void AttentionPlan::EndList() {
  lists_[n_lists_++] = {keys_.data() + list_from_, values_.data() + list_from_, next_ - list_from_};
  list_from_ = next_;
}

void AttentionPlan::EndGroup(absl::Span<const backend::ListQuery> rows) {
  const size_t first_row = n_rows_;
  for (const backend::ListQuery& q : rows) rows_[n_rows_++] = q;
  groups_[n_groups_++] = {absl::MakeConstSpan(rows_).subspan(first_row, rows.size()),
                          absl::MakeConstSpan(lists_).subspan(group_lists_, n_lists_ - group_lists_)};
  group_lists_ = n_lists_;
}

void AttentionPlan::Run(backend::Ops& ops, const backend::AttentionShape& shape, float scale) const {
  ops.AttendGroups(absl::MakeConstSpan(groups_).first(n_groups_), shape, scale);
}

}  // namespace dd::engine
