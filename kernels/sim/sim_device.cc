#include "sim/sim_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace dd::backend {

absl::StatusOr<std::unique_ptr<Device>> CreateSimDevice(const SimOptions& options) {
  if (options.pool == nullptr) return absl::InvalidArgumentError("the sim device needs a thread pool");
  if (options.budget_bytes < 0 || options.max_jitter_us < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sim device: negative budget (", options.budget_bytes,
                                                   ") or jitter (", options.max_jitter_us, " us)"));
  }
  return std::unique_ptr<Device>(new sim::SimDevice(options));
}

absl::StatusOr<SimFault> ParseSimFault(absl::string_view name) {
  if (name.empty()) return SimFault::kNone;
  if (name == "decode_attention_off_by_one") return SimFault::kDecodeAttentionOffByOne;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sim fault '", name, "' (known: decode_attention_off_by_one)"));
}

namespace sim {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

using internal::CheckRange;

SimDevice::SimDevice(const SimOptions& options)
    : budget_(options.budget_bytes),
      max_jitter_us_(options.max_jitter_us),
      seed_(options.seed),
      ops_(*this, *options.pool, options.fault) {
  for (int q = 0; q < kQueues; ++q) queues_[q].thread = std::thread([this, q] { RunQueue(q); });
}

SimDevice::~SimDevice() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (QueueState& qs : queues_) qs.thread.join();
  CHECK(buffers_.empty()) << "sim device destroyed with " << buffers_.size() << " buffers (" << total_in_use_
                          << " bytes) still allocated";
}

absl::StatusOr<DeviceBuffer> SimDevice::Allocate(MemoryTag tag, int64_t bytes) {
  if (absl::Status s = internal::CheckAllocation(tag, bytes, total_in_use_, budget_); !s.ok()) return s;
  // Buffers of 2 MiB and more are 2 MiB-aligned and asked for huge pages: every piece of work
  // opens and closes its buffers (mprotect), whose cost is per page table entry — with 4 KiB
  // pages the weights' cost most of the engine's time on the sim.
  constexpr size_t kHuge = size_t{2} << 20;
  const bool huge = static_cast<size_t>(bytes) >= kHuge;
  const size_t page = huge ? kHuge : PageSize();
  const size_t mapped = (static_cast<size_t>(std::max<int64_t>(bytes, 1)) + page - 1) / page * page;
  void* p = mmap(nullptr, mapped + (huge ? kHuge : 0), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("sim: mapping ", bytes, " bytes failed"));
  if (huge) {  // keep the aligned part
    const auto raw = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (raw + kHuge - 1) / kHuge * kHuge;
    if (aligned > raw) munmap(p, aligned - raw);
    if (raw + kHuge > aligned) munmap(reinterpret_cast<void*>(aligned + mapped), raw + kHuge - aligned);
    p = reinterpret_cast<void*>(aligned);
    (void)madvise(p, mapped, MADV_HUGEPAGE);  // a hint: where huge pages are off, 4 KiB pages
  }
  buffers_[reinterpret_cast<uintptr_t>(p)] = Buffer{mapped, bytes, tag, {}};
  in_use_[static_cast<int>(tag)] += bytes;
  total_in_use_ += bytes;
  return DeviceBuffer{p, bytes, tag};
}

void SimDevice::Free(DeviceBuffer& buf) {
  if (buf.data == nullptr) return;
  const auto it = buffers_.find(reinterpret_cast<uintptr_t>(buf.data));
  CHECK(it != buffers_.end()) << "sim: Free of a buffer this device did not allocate";
  for (const Access& a : it->second.accesses) {
    if (!Ordered(host_knows_, a)) {
      LOG(FATAL) << "sim: hazard: the host frees " << MemoryTagName(it->second.tag) << " while "
                 << QueueName(static_cast<Queue>(a.queue)) << " #" << a.seq << " (" << a.what << ") may still "
                 << (a.write ? "write" : "read") << " it: synchronize with an event recorded after that first";
    }
  }
  munmap(buf.data, it->second.mapped);  // poisoned: any later touch faults
  in_use_[static_cast<int>(it->second.tag)] -= it->second.bytes;
  total_in_use_ -= it->second.bytes;
  buffers_.erase(it);
  buf = DeviceBuffer{};
}

Event SimDevice::Record(Queue q) {
  const int i = static_cast<int>(q);
  // Waits the queue took since its last work belong to the event (as on CUDA streams): an
  // empty piece of work carries them, so completing the event means they completed too.
  if (!queues_[i].pending_waits.empty()) Submit(q, "the waits before an event", Accesses{}, [] {});
  const uint64_t seq = queues_[i].submitted;
  if (seq == 0) return Event{q, 0};
  Clock c = knows_[i];
  c[i] = seq;
  recorded_[i][seq] = c;
  return Event{q, seq};
}

void SimDevice::Wait(Queue q, const Event& e) {
  if (e.seq == 0) return;
  const int i = static_cast<int>(q), from = static_cast<int>(e.queue);
  const auto it = recorded_[from].find(e.seq);
  CHECK(it != recorded_[from].end()) << "sim: wait on an event that was not recorded";
  for (int k = 0; k < kQueues; ++k) knows_[i][k] = std::max(knows_[i][k], it->second[k]);
  queues_[i].pending_waits.push_back(e);
}

absl::Status SimDevice::Synchronize(const Event& e) {
  if (e.seq == 0) return absl::OkStatus();
  const int from = static_cast<int>(e.queue);
  const auto it = recorded_[from].find(e.seq);
  CHECK(it != recorded_[from].end()) << "sim: synchronize on an event that was not recorded";
  for (int k = 0; k < kQueues; ++k) host_knows_[k] = std::max(host_knows_[k], it->second[k]);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return completed_[from] >= e.seq; });
  return absl::OkStatus();
}

SimDevice::Buffer* SimDevice::Find(const Range& r, uintptr_t* base) {
  if (r.end <= r.begin || buffers_.empty()) return nullptr;
  auto it = buffers_.upper_bound(r.begin);
  if (it == buffers_.begin()) return nullptr;
  --it;
  if (r.begin >= it->first + it->second.mapped) return nullptr;  // host memory
  CHECK_LE(r.end, it->first + static_cast<uintptr_t>(it->second.bytes))
      << "sim: an access of " << (r.end - r.begin) << " bytes runs past the end of a "
      << MemoryTagName(it->second.tag) << " buffer of " << it->second.bytes << " bytes";
  *base = it->first;
  return &it->second;
}

void SimDevice::Check(int q, const Range& r, bool write, const std::string& what) {
  uintptr_t base = 0;
  Buffer* b = Find(r, &base);
  if (b == nullptr) {
    // Work declares device ranges only (ops' float pointers and weights, copies' device
    // side): anything else is host memory passed where the device's is due, which a CUDA
    // device would fault on.
    LOG_IF(FATAL, r.end > r.begin) << "sim: " << QueueName(static_cast<Queue>(q)) << " #"
                                   << queues_[q].submitted + 1 << " (" << what << ") "
                                   << (write ? "writes " : "reads ") << (r.end - r.begin)
                                   << " bytes of host memory: ops take device memory only";
    return;
  }
  const Access* conflict = nullptr;  // the latest unordered one names the hazard best
  for (const Access& a : b->accesses) {
    if (a.r.end <= r.begin || r.end <= a.r.begin) continue;
    if ((write || a.write) && !Ordered(knows_[q], a)) conflict = &a;
  }
  if (conflict != nullptr) {
    const Access& a = *conflict;
    LOG(FATAL) << "sim: hazard: " << QueueName(static_cast<Queue>(q)) << " #" << queues_[q].submitted + 1 << " ("
               << what << ") " << (write ? "writes " : "reads ") << MemoryTagName(b->tag) << " bytes ["
               << (r.begin - base) << ", " << (r.end - base) << "), which " << QueueName(static_cast<Queue>(a.queue))
               << " #" << a.seq << " (" << a.what << ") " << (a.write ? "writes" : "reads")
               << ", without waiting for it: record an event after it and wait on it";
  }
}

void SimDevice::Submit(Queue queue, const std::string& what, Accesses acc, std::function<void()> fn) {
  const int q = static_cast<int>(queue);
  // Work the host submits after it synchronized with an event starts after that event.
  for (int k = 0; k < kQueues; ++k) knows_[q][k] = std::max(knows_[q][k], host_knows_[k]);
  for (const Range& r : acc.reads) Check(q, r, /*write=*/false, what);
  for (const Range& r : acc.writes) Check(q, r, /*write=*/true, what);
  QueueState& qs = queues_[q];
  const uint64_t seq = qs.submitted + 1;
  Work w;
  w.seq = seq;
  w.waits = std::move(qs.pending_waits);
  qs.pending_waits.clear();
  w.fn = std::move(fn);
  auto note = [&](const Range& r, bool write) {
    uintptr_t base = 0;
    Buffer* b = Find(r, &base);
    if (b == nullptr) return;
    // The whole buffer is opened while the work runs: one mprotect per buffer, where one per
    // range split the mapping (an attention call reads thousands of key rows) past the
    // kernel's map limit. The hazard checks stay per range.
    const Range whole{base, base + b->mapped};
    if (std::none_of(w.touch.begin(), w.touch.end(), [&](const Range& t) { return t.begin == whole.begin; })) {
      w.touch.push_back(whole);
    }
    // Accesses inside this one are ordered before it (Check passed): a write supersedes them,
    // a read supersedes this queue's earlier reads.
    auto& list = b->accesses;
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](const Access& a) {
                                return a.r.begin >= r.begin && a.r.end <= r.end &&
                                       (write || (!a.write && a.queue == q));
                              }),
               list.end());
    list.push_back({r, q, seq, write, what});
  };
  for (const Range& r : acc.reads) note(r, false);
  for (const Range& r : acc.writes) note(r, true);
  knows_[q][q] = seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    qs.submitted = seq;
    qs.work.push_back(std::move(w));
  }
  cv_.notify_all();
}

void SimDevice::SetAccess(const std::vector<Range>& ranges, int prot) {
  const uintptr_t page = PageSize();
  for (const Range& r : ranges) {
    const uintptr_t b = r.begin / page * page, e = (r.end + page - 1) / page * page;
    PCHECK(mprotect(reinterpret_cast<void*>(b), e - b, prot) == 0) << "sim: mprotect";
  }
}

void SimDevice::RunQueue(int q) {
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(q));
  std::uniform_int_distribution<int64_t> jitter(0, max_jitter_us_);
  for (;;) {
    Work w;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queues_[q].work.empty(); });
      if (queues_[q].work.empty()) return;  // stopping, drained
      w = std::move(queues_[q].work.front());
      queues_[q].work.pop_front();
      for (const Event& e : w.waits) {
        const int from = static_cast<int>(e.queue);
        cv_.wait(lock, [&] { return completed_[from] >= e.seq; });
      }
    }
    if (max_jitter_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(jitter(rng)));
    {
      std::lock_guard<std::mutex> run(run_mu_);
      SetAccess(w.touch, PROT_READ | PROT_WRITE);
      w.fn();
      SetAccess(w.touch, PROT_NONE);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      completed_[q] = w.seq;
    }
    cv_.notify_all();
  }
}

absl::Status SimDevice::CopyToDevice(Queue q, const void* src, const DeviceBuffer& dst, int64_t dst_offset,
                                     int64_t bytes) {
  if (absl::Status s = CheckRange("copy to device", dst_offset, bytes, dst.bytes); !s.ok()) return s;
  char* to = static_cast<char*>(dst.data) + dst_offset;
  Accesses acc;
  acc.Write(to, bytes);
  Submit(q, absl::StrCat("copy to ", MemoryTagName(dst.tag)), std::move(acc),
         [to, src, bytes] { std::memcpy(to, src, static_cast<size_t>(bytes)); });
  return absl::OkStatus();
}

absl::Status SimDevice::CopyToHost(Queue q, const DeviceBuffer& src, int64_t src_offset, void* dst, int64_t bytes) {
  if (absl::Status s = CheckRange("copy to host", src_offset, bytes, src.bytes); !s.ok()) return s;
  const char* from = static_cast<const char*>(src.data) + src_offset;
  Accesses acc;
  acc.Read(from, bytes);
  Submit(q, absl::StrCat("copy from ", MemoryTagName(src.tag)), std::move(acc),
         [dst, from, bytes] { std::memcpy(dst, from, static_cast<size_t>(bytes)); });
  return absl::OkStatus();
}

absl::StatusOr<DeviceBuffer> SimDevice::Upload(MemoryTag tag, const void* src, int64_t bytes) {
  if (src == nullptr || bytes == 0) return absl::InvalidArgumentError("upload of no bytes");
  auto buf = Allocate(tag, bytes);
  if (!buf.ok()) return buf.status();
  absl::Status s = CopyToDevice(Queue::kCompute, src, *buf, 0, bytes);
  if (s.ok()) s = Synchronize(Record(Queue::kCompute));
  if (!s.ok()) {
    Free(*buf);
    return s;
  }
  return buf;
}

absl::Status SimDevice::Copy(Queue q, const DeviceBuffer& src, int64_t src_offset, const DeviceBuffer& dst,
                             int64_t dst_offset, int64_t bytes) {
  if (absl::Status s = internal::CheckCopy(src, src_offset, dst, dst_offset, bytes); !s.ok()) return s;
  const char* from = static_cast<const char*>(src.data) + src_offset;
  char* to = static_cast<char*>(dst.data) + dst_offset;
  Accesses acc;
  acc.Read(from, bytes);
  acc.Write(to, bytes);
  Submit(q, absl::StrCat("copy ", MemoryTagName(src.tag), " to ", MemoryTagName(dst.tag)), std::move(acc),
         [to, from, bytes] { std::memcpy(to, from, static_cast<size_t>(bytes)); });
  return absl::OkStatus();
}

absl::StatusOr<HostRegion> SimDevice::RegisterHostRegion(const void* base, int64_t bytes) {
  return regions_.Register(base, bytes);
}

void SimDevice::UnregisterHostRegion(const HostRegion& region) { regions_.Unregister(region); }

absl::Status SimDevice::Gather(Queue q, const HostRegion& region, absl::Span<const GatherBlock> blocks,
                               int64_t block_bytes, const DeviceBuffer& dst) {
  auto checked = regions_.CheckGather(region, blocks, block_bytes, dst);
  if (!checked.ok()) return checked.status();
  const HostRegion r = *checked;
  Accesses acc;
  for (const GatherBlock& b : blocks) acc.Write(static_cast<char*>(dst.data) + b.dst, block_bytes);
  std::vector<GatherBlock> list(blocks.begin(), blocks.end());
  char* to = static_cast<char*>(dst.data);
  Submit(q, absl::StrCat("gather into ", MemoryTagName(dst.tag)), std::move(acc), [r, list, block_bytes, to] {
    for (const GatherBlock& b : list) {
      std::memcpy(to + b.dst, static_cast<const char*>(r.base) + b.src, static_cast<size_t>(block_bytes));
    }
  });
  return absl::OkStatus();
}

}  // namespace sim
}  // namespace dd::backend
