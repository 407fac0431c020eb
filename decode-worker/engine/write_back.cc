#include "decode-worker/engine/write_back.h"

#include "common/status_macros.h"

namespace dd::engine {

absl::Status WriteBack::Start(const LayerRows& st, kvpool::SequenceId id, int64_t layer, int64_t c0, int64_t c1) {
  Entry e{.id = id, .layer = layer, .c0 = c0, .c1 = c1, .offset = used_};
  const int64_t bytes = Bytes(e);
  const int64_t need = used_ + 2 * bytes;
  if (need > staging_.bytes()) {
    // The staging grows to hold all of it (geometrically, so this settles): what is on its way
    // goes first.
    RETURN_IF_ERROR(Flush());
    e.offset = 0;
    RETURN_IF_ERROR(staging_.Ensure(device_, need));
  }
  uint8_t* k = staging_.data() + e.offset;
  // After the compute queue's writes of the rows.
  device_.Wait(backend::Queue::kWriteBack, device_.Record(backend::Queue::kCompute));
  RETURN_IF_ERROR(rows_.ToHost(backend::Queue::kWriteBack, st, c0 * chunk_, c1 * chunk_, k, k + bytes));
  staging_.last_read = device_.Record(backend::Queue::kWriteBack);
  used_ = e.offset + 2 * bytes;
  entries_.push_back(e);
  return absl::OkStatus();
}

absl::Status WriteBack::Flush() {
  if (entries_.empty()) return absl::OkStatus();
  absl::Status status = device_.Synchronize(staging_.last_read);
  for (const Entry& e : entries_) {
    if (!status.ok()) break;
    const uint8_t* k = staging_.data() + e.offset;
    status = chunks_.WriteChunks(e.id, e.layer, e.c0, e.c1, k, k + Bytes(e));
  }
  entries_.clear();
  used_ = 0;
  return status;
}

void WriteBack::Discard() {
  if (!entries_.empty()) (void)device_.Synchronize(staging_.last_read);
  entries_.clear();
  used_ = 0;
}

}  // namespace dd::engine
