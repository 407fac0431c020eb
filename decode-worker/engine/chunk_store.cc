#include "decode-worker/engine/chunk_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "common/status_macros.h"
#include "decode-worker/engine/kv_block.h"
#include "decode-worker/engine/prefix_reuse.h"

namespace dd::engine {

using backend::Queue;

namespace {
std::atomic<bool> skip_compute_wait{false};
}  // namespace

void ChunkStore::SkipComputeWaitForTesting(bool skip) { skip_compute_wait = skip; }

ChunkStore::HostStaging& ChunkStore::HostStaging::operator=(HostStaging&& o) noexcept {
  if (this != &o) {
    Release();
    Take(o);
  }
  return *this;
}

void ChunkStore::HostStaging::Take(HostStaging& o) {
  device_ = o.device_, data_ = o.data_, bytes_ = o.bytes_, region_ = o.region_, registered_ = o.registered_;
  last_read = o.last_read;
  o.data_ = nullptr, o.bytes_ = 0, o.registered_ = false, o.last_read = {};
}

void ChunkStore::HostStaging::Release() {
  if (data_ == nullptr) return;
  if (device_ != nullptr) (void)device_->Synchronize(last_read);  // the device's last read is done
  if (registered_) device_->UnregisterHostRegion(region_);
  munmap(data_, static_cast<size_t>(bytes_));
  data_ = nullptr, bytes_ = 0, registered_ = false, last_read = {};
}

absl::Status ChunkStore::HostStaging::Ensure(backend::Device& device, int64_t bytes) {
  if (bytes <= bytes_) return absl::OkStatus();
  const int64_t had = bytes_;
  Release();
  // Geometric growth in whole pages: a landing's staging settles at its largest landing.
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t size = std::max<int64_t>({64 << 10, bytes, 2 * had});
  size = (size + page - 1) / page * page;
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("host staging of ", size, " bytes: mmap failed"));
  device_ = &device, data_ = p, bytes_ = size;
  auto region = device.RegisterHostRegion(p, size);
  if (region.ok()) {
    region_ = *region;
    registered_ = true;
  } else {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      LOG(WARNING) << "the device cannot register host staging (" << size
                   << " bytes): blocks land by one copy each instead: " << region.status();
    }
  }
  return absl::OkStatus();
}

ChunkStore::ChunkStore(const model::ModelConfig& config, int64_t chunk_tokens, kvpool::KvStore* store,
                       backend::Device& device, bool device_gathers, KvDtype kv)
    : config_(config), chunk_(chunk_tokens), store_(store), device_(device), caps_(device.caps()),
      device_gathers_(device_gathers), kv_(kv) {}

ChunkStore::~ChunkStore() { ForgetMappings(); }

absl::StatusOr<kvpool::SequenceId> ChunkStore::Open() {
  (void)DeviceGathers();
  return store_->Open(layout());
}

void ChunkStore::ForgetMappings() {
  if (!regions_.empty()) {
    for (Queue q : {Queue::kUrgent, Queue::kPrefetch}) (void)device_.Synchronize(device_.Record(q));
    for (const backend::HostRegion& r : regions_) device_.UnregisterHostRegion(r);
  }
  regions_.clear();
  generation_ = kUnchecked;
  refused_ = false;
}

bool ChunkStore::DeviceGathers() {
  if (caps_.host_reads_device_memory) return false;  // the transfer thread writes device memory itself
  if (!device_gathers_) return false;
  const int64_t generation = store_->MappingGeneration();
  if (refused_ || generation == generation_) return !regions_.empty();
  // Once per change of the mapping: the ranges not registered yet (ranges are only added,
  // except in the store's Recover, after ForgetMappings).
  generation_ = generation;
  for (const kvpool::KvStore::MappedRange& r : store_->MappedRanges()) {
    if (std::any_of(regions_.begin(), regions_.end(), [&](const backend::HostRegion& h) { return h.base == r.base; })) {
      continue;
    }
    auto region = device_.RegisterHostRegion(r.base, r.bytes);
    if (!region.ok()) {
      LOG(WARNING) << "the device cannot register the KV store's mapped memory (" << r.bytes
                   << " bytes): its blocks land through host staging instead: " << region.status();
      ForgetMappings();
      refused_ = true;  // not tried again before ForgetMappings
      return false;
    }
    regions_.insert(std::upper_bound(regions_.begin(), regions_.end(), *region,
                                     [](const backend::HostRegion& a, const backend::HostRegion& b) {
                                       return static_cast<const char*>(a.base) < static_cast<const char*>(b.base);
                                     }),
                    *region);
  }
  return !regions_.empty();
}

absl::Status ChunkStore::StartDeviceGather(kvpool::SequenceId id, absl::Span<const kvpool::ChunkRef> refs,
                                           const std::vector<BlockDst>& dsts, kvpool::Priority priority,
                                           Landing* l) {
  RETURN_IF_ERROR(store_->BlockAddresses(id, refs, &addrs_));
  if (addrs_.size() != refs.size()) {
    return absl::InternalError(absl::StrCat("the KV store gave ", addrs_.size(), " addresses for ", refs.size(), " blocks"));
  }
  const Queue q = priority == kvpool::Priority::kUrgent ? Queue::kUrgent : Queue::kPrefetch;
  // The blocks overwrite slots that attention calls enqueued so far may read: after them.
  device_.Wait(q, device_.Record(Queue::kCompute));
  // One gather per run of blocks from one range into one buffer. regions_ is sorted by base:
  // a block's range is the last starting at or before it.
  auto range_of = [&](const void* a) -> int {
    const auto* p = static_cast<const char*>(a);
    auto it = std::upper_bound(regions_.begin(), regions_.end(), p, [](const char* x, const backend::HostRegion& h) {
      return x < static_cast<const char*>(h.base);
    });
    if (it == regions_.begin()) return -1;
    --it;
    const auto* base = static_cast<const char*>(it->base);
    return p + block_bytes() <= base + it->bytes ? static_cast<int>(it - regions_.begin()) : -1;
  };
  ranges_.resize(refs.size());
  for (size_t i = 0; i < refs.size(); ++i) ranges_[i] = range_of(addrs_[i]);
  const int64_t off = part_offset(l->part), bytes = part_bytes(l->part);
  for (size_t i = 0; i < refs.size();) {
    const int r = ranges_[i];
    if (r < 0) {
      (void)device_.Synchronize(device_.Record(q));  // the runs enqueued before it
      return absl::InternalError("a block's address lies outside the KV store's mapped memory");
    }
    const char* base = static_cast<const char*>(regions_[r].base);
    gather_.clear();
    size_t j = i;
    for (; j < refs.size() && dsts[j].buf.data == dsts[i].buf.data && ranges_[j] == r; ++j) {
      gather_.push_back({static_cast<const char*>(addrs_[j]) - base + off, dsts[j].offset + off});
    }
    if (absl::Status st = device_.Gather(q, regions_[r], gather_, bytes, dsts[i].buf); !st.ok()) {
      // Runs enqueued before this one may still write their slots: done before the error.
      (void)device_.Synchronize(device_.Record(q));
      return st;
    }
    i = j;
  }
  l->copied = device_.Record(q);
  l->on_device = true;
  l->pending = true;
  Landed(static_cast<int64_t>(refs.size()), l->part);
  counts_.device_gathered += static_cast<int64_t>(refs.size());
  return absl::OkStatus();
}

void ChunkStore::Landed(int64_t blocks, kvpool::BlockPart part) {
  counts_.fetched += blocks;
  if (part == kvpool::BlockPart::kValues) counts_.values_only += blocks;
}

absl::Status ChunkStore::WriteChunks(kvpool::SequenceId id, int64_t layer, int64_t c0, int64_t c1, const void* k,
                                     const void* v) {
  const int64_t C = chunk_, hb = head_bytes(), n_kv = config_.n_head_kv, row = n_kv * hb;
  block_.resize(block_bytes());
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* kr = static_cast<const uint8_t*>(k) + (c - c0) * C * row;
    const uint8_t* vr = static_cast<const uint8_t*>(v) + (c - c0) * C * row;
    for (int32_t g = 0; g < n_kv; ++g) {
      PackKvBlock(C, hb, g, [&](int64_t t) { return kr + t * row; }, [&](int64_t t) { return vr + t * row; },
                  block_.data());
      RETURN_IF_ERROR(store_->Write(id, {static_cast<int32_t>(layer), g, c}, block_.data()));
    }
  }
  // Memory the store mapped for these blocks (the in-process arena's new slab) is registered
  // now, during the prefill that wrote them, not in a later decode step that every request of
  // the batch waits for (registering pins it: slow).
  (void)DeviceGathers();
  return absl::OkStatus();
}

absl::Status ChunkStore::CopyBlocks(kvpool::SequenceId from, kvpool::SequenceId to,
                                    absl::Span<const int64_t> chunks_per_layer) {
  // Up to kBatch blocks per transfer (one gather per block made a 32K-token fork cost seconds
  // over a pool).
  constexpr size_t kBatch = 256;
  const size_t bytes = static_cast<size_t>(block_bytes());
  std::vector<kvpool::ChunkRef> refs;
  std::vector<uint8_t> blocks;
  auto flush = [&]() -> absl::Status {
    if (refs.empty()) return absl::OkStatus();
    blocks.resize(refs.size() * bytes);
    ASSIGN_OR_RETURN(kvpool::TransferId t, store_->Gather(from, refs, blocks.data(), kvpool::Priority::kBackground));
    RETURN_IF_ERROR(store_->Wait(t));
    for (size_t i = 0; i < refs.size(); ++i) RETURN_IF_ERROR(store_->Write(to, refs[i], &blocks[i * bytes]));
    refs.clear();
    return absl::OkStatus();
  };
  for (size_t l = 0; l < chunks_per_layer.size(); ++l) {
    for (int64_t c = 0; c < chunks_per_layer[l]; ++c) {
      for (int32_t g = 0; g < config_.n_head_kv; ++g) {
        refs.push_back({static_cast<int32_t>(l), g, c});
        if (refs.size() == kBatch) RETURN_IF_ERROR(flush());
      }
    }
  }
  RETURN_IF_ERROR(flush());
  (void)DeviceGathers();  // a fork's new slabs, registered now (see WriteChunks)
  return absl::OkStatus();
}

absl::Status ChunkStore::ReadRows(kvpool::SequenceId handle, int64_t layer, int64_t c0, int64_t c1,
                                  std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
  const int64_t C = chunk_, hb = head_bytes(), n_kv = config_.n_head_kv, row = n_kv * hb;
  std::vector<uint8_t> blocks;
  RETURN_IF_ERROR(GatherLayerChunks(*store_, handle, static_cast<int32_t>(layer), c0, c1, static_cast<int32_t>(n_kv),
                                    block_bytes(), &blocks));
  k->resize((c1 - c0) * C * row);
  v->resize((c1 - c0) * C * row);
  for (int64_t c = c0; c < c1; ++c) {
    uint8_t* kr = k->data() + (c - c0) * C * row;
    uint8_t* vr = v->data() + (c - c0) * C * row;
    for (int64_t g = 0; g < n_kv; ++g) {
      UnpackKvBlock(C, hb, g, &blocks[((c - c0) * n_kv + g) * block_bytes()],
                    [&](int64_t t) { return kr + t * row; }, [&](int64_t t) { return vr + t * row; });
    }
  }
  return absl::OkStatus();
}

absl::Status ChunkStore::StartLanding(kvpool::SequenceId id, absl::Span<const kvpool::ChunkRef> refs,
                                      std::vector<BlockDst> dsts, kvpool::Priority priority, Landing* l,
                                      kvpool::BlockPart part) {
  l->tid = 0;
  l->pending = false;
  l->on_device = false;
  l->direct = false;
  l->part = part;
  const int64_t off = part_offset(part), bytes = part_bytes(part);
  l->dsts.clear();  // a failed finish may have left the last landing's
  if (refs.empty()) return absl::OkStatus();
  if (refs.size() != dsts.size()) {
    return absl::InternalError(absl::StrCat("a landing of ", refs.size(), " blocks into ", dsts.size(), " places"));
  }
  if (DeviceGathers()) return StartDeviceGather(id, refs, dsts, priority, l);
  const bool in_place = caps_.host_reads_device_memory;
  const bool direct = !in_place && !direct_off_ && caps_.transport_writes_device_memory && store_->WritesDeviceMemory();
  if (in_place || direct) {
    // The store's transport writes the slots itself. Into device memory (GPUDirect) only after
    // the device's earlier readers of those slots: the host waits for the compute queue.
    if (direct) RETURN_IF_ERROR(device_.Synchronize(device_.Record(Queue::kCompute)));
    std::vector<void*> ptrs(dsts.size());
    for (size_t i = 0; i < dsts.size(); ++i) ptrs[i] = static_cast<char*>(dsts[i].buf.data) + dsts[i].offset + off;
    if (direct) {
      absl::StatusOr<kvpool::TransferId> tid =
          store_->GatherTo(id, refs, ptrs, priority, kvpool::DstMemory::kDevice, part);
      if (!tid.ok()) return DirectFailed(tid.status());
      l->tid = *tid;
      l->direct = true;
      counts_.direct += static_cast<int64_t>(refs.size());
    } else {
      ASSIGN_OR_RETURN(l->tid, store_->GatherTo(id, refs, ptrs, priority, kvpool::DstMemory::kHost, part));
    }
  } else {
    RETURN_IF_ERROR(device_.Synchronize(l->copied));  // the staging's last copy has been read
    l->copied = {};
    RETURN_IF_ERROR(l->staging.Ensure(device_, static_cast<int64_t>(refs.size()) * bytes));
    std::vector<void*> ptrs(refs.size());
    for (size_t i = 0; i < refs.size(); ++i) ptrs[i] = l->staging.data() + static_cast<int64_t>(i) * bytes;
    ASSIGN_OR_RETURN(l->tid, store_->GatherTo(id, refs, ptrs, priority, kvpool::DstMemory::kHost, part));
    if (l->staging.registered()) counts_.staged_gathered += static_cast<int64_t>(refs.size());
    l->dsts = std::move(dsts);
  }
  l->pending = true;
  Landed(static_cast<int64_t>(refs.size()), part);
  return absl::OkStatus();
}

absl::Status ChunkStore::DirectFailed(const absl::Status& st) {
  // A UCX that lists CUDA memory may still fail to write it (no GPUDirect path after all):
  // later landings take the host staging; this one's error still reaches the caller.
  if (!direct_off_) {
    LOG(WARNING) << "kv store: a gather straight into CUDA memory failed (" << st
                 << "); landings go through pinned host staging from now on";
  }
  direct_off_ = true;
  return st;
}

absl::Status ChunkStore::FinishLanding(Landing& l, Queue q) {
  if (!l.pending) return absl::OkStatus();
  l.pending = false;
  if (l.on_device) {  // enqueued at the start: the compute queue waits for it
    l.on_device = false;
    if (!skip_compute_wait) device_.Wait(Queue::kCompute, l.copied);
    return absl::OkStatus();
  }
  const kvpool::TransferId tid = l.tid;
  l.tid = 0;
  const absl::Status waited = tid == 0 ? absl::OkStatus() : store_->Wait(tid);
  if (!waited.ok()) return l.direct ? DirectFailed(waited) : waited;
  if (caps_.host_reads_device_memory || l.dsts.empty()) return absl::OkStatus();
  // The blocks overwrite slots earlier attention calls read: after them. (Today the host has
  // synchronized with the compute queue since, to read the landmark scores; this wait keeps
  // the order when selection no longer makes it.)
  device_.Wait(q, device_.Record(Queue::kCompute));
  const size_t n = l.dsts.size();
  const int64_t off = part_offset(l.part), bytes = part_bytes(l.part);  // the staging holds the parts
  absl::Status moved;
  if (l.staging.registered()) {  // one gather per destination buffer
    for (size_t i = 0; i < n && moved.ok();) {
      gather_.clear();
      size_t j = i;
      for (; j < n && l.dsts[j].buf.data == l.dsts[i].buf.data; ++j) {
        gather_.push_back({static_cast<int64_t>(j) * bytes, l.dsts[j].offset + off});
      }
      moved = device_.Gather(q, l.staging.region(), gather_, bytes, l.dsts[i].buf);
      i = j;
    }
  } else {
    for (size_t i = 0; i < n && moved.ok(); ++i) {
      moved = device_.CopyToDevice(q, l.staging.data() + i * bytes, l.dsts[i].buf, l.dsts[i].offset + off, bytes);
    }
  }
  l.dsts.clear();
  l.copied = device_.Record(q);
  l.staging.last_read = l.copied;
  if (!moved.ok()) {
    (void)device_.Synchronize(l.copied);  // what was enqueued before the error still writes its slots
    return moved;
  }
  if (!skip_compute_wait) device_.Wait(Queue::kCompute, l.copied);
  return absl::OkStatus();
}

}  // namespace dd::engine
