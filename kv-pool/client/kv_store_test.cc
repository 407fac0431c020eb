#include "kv-pool/client/kv_store.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "kv-pool/client/block_arena.h"
#include "kv-pool/client/transfer_queue.h"

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

TEST(InProcessKvStoreTest, WriteGatherRoundTripAndErrors) {
  auto store = NewInProcessKvStore();
  KvLayout layout{.n_layers = 2, .n_kv_heads = 3, .head_dim = 4, .chunk_tokens = 2};
  auto seq = store->Open(layout);
  ASSERT_TRUE(seq.ok());
  const int64_t bf = (layout.block_bytes() / 4);
  for (int64_t c = 0; c < 5; ++c) {
    std::vector<float> block(bf, static_cast<float>(c) + 0.5f);
    ASSERT_TRUE(store->Write(*seq, {1, 2, c}, block.data()).ok());
  }
  EXPECT_EQ(store->bytes_stored(), 5 * bf * 4);
  std::vector<ChunkRef> refs = {{1, 2, 4}, {1, 2, 0}};
  std::vector<float> dst(2 * bf, -1.0f);
  auto t = store->Gather(*seq, refs, dst.data(), Priority::kUrgent);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(store->Wait(*t).ok());
  EXPECT_EQ(dst[0], 4.5f);
  EXPECT_EQ(dst[bf], 0.5f);
  // Scattered destinations, on the infinite link and through the transfer thread.
  for (double gbps : {0.0, 1.0}) {
    store->SetLink({.bandwidth_gbps = gbps});
    std::vector<float> a(bf, -1.0f), b(bf, -1.0f);
    std::vector<void*> dsts = {b.data(), a.data()};
    auto s = store->GatherTo(*seq, refs, dsts, Priority::kBackground);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(store->Wait(*s).ok());
    EXPECT_EQ(b[0], 4.5f);
    EXPECT_EQ(a[bf - 1], 0.5f);
  }
  // The V halves alone: half a block each, from the block's middle on, nothing else written.
  for (double gbps : {0.0, 1.0}) {
    store->SetLink({.bandwidth_gbps = gbps});
    std::vector<float> blocks(bf, -1.0f);
    for (int64_t i = 0; i < bf; ++i) blocks[i] = static_cast<float>(i);  // distinct halves
    ASSERT_TRUE(store->Write(*seq, {0, 1, 7}, blocks.data()).ok());
    std::vector<float> a(bf, -1.0f);
    std::vector<void*> dsts = {a.data()};
    const std::vector<ChunkRef> one_ref = {{0, 1, 7}};
    auto s = store->GatherTo(*seq, one_ref, dsts, Priority::kBackground, DstMemory::kHost, BlockPart::kValues);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(store->Wait(*s).ok());
    for (int64_t i = 0; i < bf / 2; ++i) EXPECT_EQ(a[i], static_cast<float>(bf / 2 + i));
    for (int64_t i = bf / 2; i < bf; ++i) EXPECT_EQ(a[i], -1.0f);
  }
  std::vector<void*> one = {dst.data()};
  EXPECT_EQ(store->GatherTo(*seq, refs, one, Priority::kUrgent).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Layout(*seq)->block_bytes(), bf * 4);
  EXPECT_EQ(store->Layout(*seq + 100).status().code(), absl::StatusCode::kNotFound);
  // Never written, out of layout, unknown sequence.
  std::vector<ChunkRef> missing = {{0, 0, 1}};
  EXPECT_EQ(store->Gather(*seq, missing, dst.data(), Priority::kBackground).status().code(), absl::StatusCode::kNotFound);
  std::vector<ChunkRef> bad = {{2, 0, 1}};
  EXPECT_EQ(store->Gather(*seq, bad, dst.data(), Priority::kBackground).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Release(*seq + 100).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store->Release(*seq).ok());
  EXPECT_EQ(store->bytes_stored(), 0);
  EXPECT_FALSE(store->Open(KvLayout{}).ok());
}

// lanes = 0 on an infinite link copies inside Submit (the in-process store's model); with
// lanes >= 1 background jobs run on lane threads, `lanes` of them in flight at once (each job
// below waits, with a deadline, until all of them have started), while an urgent job on an
// infinite link still runs in its caller (who waits for it at once), and so does one on a
// modelled link (on the link's clock: UrgentJobsGoBetweenABackgroundJobsPieces).
// A sequence of one layer, one head and `chunks` chunks of 8 tokens × 4 floats, block c filled
// with c + base; its prefix committed under `keys` (one block of one chunk per key).
SequenceId CommittedSequence(KvStore& store, int64_t chunks, float base, const std::vector<uint64_t>& keys,
                             uint64_t owner = 0) {
  const KvLayout layout{1, 1, 4, 8};
  auto seq = store.Open(layout);
  EXPECT_TRUE(seq.ok());
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<float> block((layout.block_bytes() / 4), base + static_cast<float>(c));
    EXPECT_TRUE(store.Write(*seq, {0, 0, c}, block.data()).ok());
  }
  EXPECT_TRUE(store.CommitPrefix(*seq, keys, owner).ok());
  return *seq;
}

TEST(InProcessKvStoreTest, ACommittedPrefixOutlivesItsSequenceUntilEvicted) {
  const KvLayout layout{1, 1, 4, 8};
  const int64_t block_bytes = layout.block_bytes();
  auto store = NewInProcessKvStore({}, /*prefix_cache_bytes=*/3 * block_bytes);
  const SequenceId a = CommittedSequence(*store, 2, 10.0f, {101, 102});
  ASSERT_TRUE(store->Release(a).ok());
  EXPECT_FALSE(store->Layout(a).ok()) << "a released sequence is gone by its own id";
  // The longest committed prefix of a request that shares the first block only.
  auto m = store->LookupPrefix({101, 999}, layout, 1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->blocks, 1);
  ASSERT_TRUE(store->Release(m->seq).ok());
  m = store->LookupPrefix({101, 102, 103}, layout, 1);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->blocks, 2);
  std::vector<float> out(2 * (layout.block_bytes() / 4));
  const ChunkRef refs[] = {{0, 0, 0}, {0, 0, 1}};
  auto t = store->Gather(m->seq, refs, out.data(), Priority::kUrgent);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(store->Wait(*t).ok());
  EXPECT_EQ(out[0], 10.0f);
  EXPECT_EQ(out[(layout.block_bytes() / 4)], 11.0f);
  // Another layout does not match; neither does a key nobody committed.
  EXPECT_EQ(store->LookupPrefix({101}, KvLayout{1, 1, 8, 8}, 1)->blocks, 0);
  EXPECT_EQ(store->LookupPrefix({101}, KvLayout{1, 1, 4, 8, KvDtype::kF16}, 1)->blocks, 0) << "another KV type";
  EXPECT_EQ(store->LookupPrefix({555}, layout, 1)->blocks, 0);

  // a is being read (its handle is open): b, which overflows the cache, is evicted instead.
  const SequenceId b = CommittedSequence(*store, 2, 20.0f, {201, 202});
  ASSERT_TRUE(store->Release(b).ok());
  EXPECT_EQ(store->LookupPrefix({201}, layout, 1)->blocks, 0);
  ASSERT_TRUE(store->Release(m->seq).ok());
  // With no handle open the least recently used goes: a, not the newer c.
  const SequenceId c = CommittedSequence(*store, 2, 30.0f, {301, 302});
  ASSERT_TRUE(store->Release(c).ok());
  EXPECT_EQ(store->LookupPrefix({101}, layout, 1)->blocks, 0);
  m = store->LookupPrefix({301, 302}, layout, 1);
  EXPECT_EQ(m->blocks, 2);
  ASSERT_TRUE(store->Release(m->seq).ok());
  EXPECT_EQ(store->bytes_stored(), 2 * block_bytes);
}

// Owners (tenants' prefix namespaces) each hold a share of the cache, and one owner's
// releases evict only its own prefixes: a tenant's flood of prompts neither evicts another's
// cached prefix nor, by timing its own, learns when the other was active.
TEST(InProcessKvStoreTest, OneOwnersReleasesEvictOnlyItsOwnPrefixes) {
  const KvLayout layout{1, 1, 4, 8};
  const int64_t block_bytes = layout.block_bytes();
  constexpr uint64_t kA = 0xA, kB = 0xB;
  auto store = NewInProcessKvStore({}, /*prefix_cache_bytes=*/4 * block_bytes, /*owner_bytes=*/2 * block_bytes);
  ASSERT_TRUE(store->Release(CommittedSequence(*store, 2, 1.0f, {11, 12}, kA)).ok());
  // B's flood: far more than the cache, a prefix at a time. (One LRU for all, as before owners,
  // evicted A's prefix at B's second release.)
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_TRUE(store->Release(CommittedSequence(*store, 2, 2.0f, {100 + 2 * i, 101 + 2 * i}, kB)).ok());
  }
  // B keeps its newest prefix within its share; A's is untouched.
  EXPECT_EQ(store->LookupPrefix({100, 101}, layout, 1)->blocks, 0);
  auto m = store->LookupPrefix({108, 109}, layout, 1);
  EXPECT_EQ(m->blocks, 2);
  ASSERT_TRUE(store->Release(m->seq).ok());
  m = store->LookupPrefix({11, 12}, layout, 1);
  ASSERT_EQ(m->blocks, 2);
  ASSERT_TRUE(store->Release(m->seq).ok());
  // A's next prefix takes the place of its older one, within its own share: B's stays.
  ASSERT_TRUE(store->Release(CommittedSequence(*store, 2, 3.0f, {21, 22}, kA)).ok());
  EXPECT_EQ(store->LookupPrefix({11}, layout, 1)->blocks, 0);
  m = store->LookupPrefix({21, 22}, layout, 1);
  EXPECT_EQ(m->blocks, 2);
  ASSERT_TRUE(store->Release(m->seq).ok());
  m = store->LookupPrefix({108, 109}, layout, 1);
  EXPECT_EQ(m->blocks, 2);
  ASSERT_TRUE(store->Release(m->seq).ok());
  EXPECT_EQ(store->bytes_stored(), 4 * block_bytes);
}

TEST(InProcessKvStoreTest, WithoutACacheNothingIsKept) {
  auto store = NewInProcessKvStore();
  const SequenceId a = CommittedSequence(*store, 1, 1.0f, {7});
  ASSERT_TRUE(store->Release(a).ok());
  EXPECT_EQ(store->LookupPrefix({7}, KvLayout{1, 1, 4, 8}, 1)->blocks, 0);
  EXPECT_EQ(store->bytes_stored(), 0);
}

// The in-process store keeps its blocks in an arena of slabs it maps (a device registers them
// and gathers from them itself): the ranges only grow, each growth changes the generation, the
// addresses hold the written bytes inside the ranges, and a released sequence's slots are
// reused rather than new memory mapped.
TEST(InProcessKvStoreTest, BlocksLieInTheArenaItMaps) {
  auto store = NewInProcessKvStore({}, 0);
  EXPECT_TRUE(store->MappedRanges().empty());
  const int64_t g0 = store->MappingGeneration();
  const KvLayout layout{2, 2, 64, 8};
  const int64_t floats = (layout.block_bytes() / 4);
  auto seq = store->Open(layout);
  ASSERT_TRUE(seq.ok());
  std::vector<ChunkRef> refs;
  std::vector<float> block(floats);
  for (int32_t l = 0; l < 2; ++l) {
    for (int32_t g = 0; g < 2; ++g) {
      for (int64_t c = 0; c < 3; ++c) {
        for (int64_t i = 0; i < floats; ++i) block[i] = static_cast<float>(l * 1000 + g * 100 + c) + i * 1e-3f;
        ASSERT_TRUE(store->Write(*seq, {l, g, c}, block.data()).ok());
        refs.push_back({l, g, c});
      }
    }
  }
  const std::vector<KvStore::MappedRange> ranges = store->MappedRanges();
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_NE(store->MappingGeneration(), g0);
  std::vector<const void*> addrs;
  ASSERT_TRUE(store->BlockAddresses(*seq, refs, &addrs).ok());
  ASSERT_EQ(addrs.size(), refs.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    const auto* p = static_cast<const float*>(addrs[i]);
    const auto* base = static_cast<const char*>(ranges[0].base);
    EXPECT_TRUE(reinterpret_cast<const char*>(p) >= base &&
                reinterpret_cast<const char*>(p + floats) <= base + ranges[0].bytes);
    EXPECT_EQ(p[0], static_cast<float>(refs[i].layer * 1000 + refs[i].kv_head * 100 + refs[i].chunk));
  }
  EXPECT_EQ(store->BlockAddresses(*seq, {{0, 0, 9}}, &addrs).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(addrs.empty());
  EXPECT_EQ(store->BlockAddresses(*seq + 100, refs, &addrs).code(), absl::StatusCode::kNotFound);
  // Released, its slots serve the next sequence: no new range.
  const int64_t g1 = store->MappingGeneration();
  ASSERT_TRUE(store->Release(*seq).ok());
  auto next = store->Open(layout);
  ASSERT_TRUE(next.ok());
  for (const ChunkRef& r : refs) ASSERT_TRUE(store->Write(*next, r, block.data()).ok());
  EXPECT_EQ(store->MappingGeneration(), g1);
  EXPECT_EQ(store->MappedRanges().size(), 1u);
}

TEST(BlockArenaTest, SlotsAreAlignedDistinctAndReusedBySize) {
  BlockArena arena(/*slab_bytes=*/1 << 16);
  std::vector<float*> a;
  for (int i = 0; i < 40; ++i) {  // 40 × 4 KiB: three slabs of 64 KiB
    auto p = arena.Allocate(4096);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 64, 0u);
    a.push_back(*p);
  }
  EXPECT_EQ(arena.ranges().size(), 3u);
  std::sort(a.begin(), a.end());
  EXPECT_EQ(std::adjacent_find(a.begin(), a.end()), a.end());
  arena.Free(a[5], 4096);
  auto again = arena.Allocate(4050);  // the same 4096-byte stride (64-byte multiples)
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, a[5]);
  auto other = arena.Allocate(100);  // another size: its own slots
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(std::find(a.begin(), a.end(), *other), a.end());
  EXPECT_FALSE(arena.Allocate(0).ok());
  // A slot larger than a slab gets a slab of its own.
  auto big = arena.Allocate(1 << 20);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(arena.ranges().back().bytes, 1 << 20);
}

TEST(TransferQueueTest, LanesRunBackgroundJobsOffTheCallerAndInParallel) {
  const std::thread::id caller = std::this_thread::get_id();
  auto ran_on = [](TransferQueue& queue, Priority priority) {
    std::thread::id ran;
    TransferQueue::Job job;
    job.fetch = [&](size_t, size_t) {
      ran = std::this_thread::get_id();
      return absl::OkStatus();
    };
    EXPECT_TRUE(queue.Wait(queue.Submit(std::move(job), priority)).ok());
    return ran;
  };
  {
    TransferQueue inline_queue(LinkModel{}, 0);
    EXPECT_EQ(ran_on(inline_queue, Priority::kUrgent), caller);
    EXPECT_EQ(ran_on(inline_queue, Priority::kBackground), caller);
    TransferQueue laned(LinkModel{}, 2);
    EXPECT_EQ(ran_on(laned, Priority::kUrgent), caller);
    EXPECT_NE(ran_on(laned, Priority::kBackground), caller);
    TransferQueue modelled(LinkModel{.bandwidth_gbps = 100, .latency_us = 1}, 1);
    EXPECT_EQ(ran_on(modelled, Priority::kUrgent), caller);
    EXPECT_NE(ran_on(modelled, Priority::kBackground), caller);
    // A job run inline is time the caller's compute stood still: it counts as waiting.
    const int64_t before = laned.wait_ns();
    TransferQueue::Job slow;
    slow.fetch = [](size_t, size_t) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
      while (std::chrono::steady_clock::now() < until) {
      }
      return absl::OkStatus();
    };
    ASSERT_TRUE(laned.Wait(laned.Submit(std::move(slow), Priority::kUrgent)).ok());
    EXPECT_GE(laned.wait_ns() - before, 5'000'000);
  }
  for (int lanes : {1, 3}) {
    TransferQueue queue(LinkModel{}, lanes);
    std::mutex mu;
    std::condition_variable cv;
    int started = 0;
    std::vector<std::thread::id> threads;
    std::vector<TransferId> ids;
    for (int j = 0; j < lanes; ++j) {
      TransferQueue::Job job;
      job.fetch = [&](size_t, size_t) {
        std::unique_lock<std::mutex> lock(mu);
        threads.push_back(std::this_thread::get_id());
        ++started;
        cv.notify_all();
        if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return started == lanes; })) {
          return absl::DeadlineExceededError("the other lanes' jobs never started");
        }
        return absl::OkStatus();
      };
      ids.push_back(queue.Submit(std::move(job), Priority::kBackground));
    }
    for (TransferId id : ids) EXPECT_TRUE(queue.Wait(id).ok()) << "lanes=" << lanes;
    ASSERT_EQ(static_cast<int>(threads.size()), lanes);
    for (std::thread::id t : threads) EXPECT_NE(t, caller) << "lanes=" << lanes;
  }
}

// A background job is served in pieces, and an urgent job submitted behind it runs between
// two pieces instead of after the whole job (a modelled link: 4 ms per 32 KiB piece, 64 pieces),
// taking at least its own time on the link (4 KiB: 0.5 ms) and at most about one piece more.
TEST(TransferQueueTest, UrgentJobsGoBetweenABackgroundJobsPieces) {
  const int64_t block_floats = 1024;  // 4 KiB blocks, 8 per piece
  const int64_t blocks = 8 * 64;
  TransferQueue queue(LinkModel{.bandwidth_gbps = 32768.0 / 4e6}, 0);
  std::mutex mu;
  std::vector<std::pair<size_t, size_t>> pieces;
  size_t background_pieces_before_urgent = 0;
  std::vector<float> sink(block_floats);
  TransferQueue::Job background;
  background.dst.assign(blocks, sink.data());
  background.block_bytes = block_floats * 4;
  background.fetch = [&](size_t begin, size_t end) {
    std::lock_guard<std::mutex> lock(mu);
    pieces.emplace_back(begin, end);
    return absl::OkStatus();
  };
  TransferQueue::Job urgent;
  urgent.dst.assign(1, sink.data());
  urgent.block_bytes = block_floats * 4;
  urgent.fetch = [&](size_t, size_t) {
    std::lock_guard<std::mutex> lock(mu);
    background_pieces_before_urgent = pieces.size();
    return absl::OkStatus();
  };
  const TransferId b = queue.Submit(std::move(background), Priority::kBackground);
  const auto t0 = std::chrono::steady_clock::now();
  const TransferId u = queue.Submit(std::move(urgent), Priority::kUrgent);
  ASSERT_TRUE(queue.Wait(u).ok());
  const double urgent_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(queue.Wait(b).ok());
  EXPECT_GE(urgent_ms, 0.5);
  EXPECT_LT(urgent_ms, 128.0) << "the urgent job waited for much of the background job";
  ASSERT_EQ(pieces.size(), 64u);
  for (size_t i = 0; i < pieces.size(); ++i) {  // in order, contiguous, 8 blocks each
    EXPECT_EQ(pieces[i].first, i * 8);
    EXPECT_EQ(pieces[i].second, i * 8 + 8);
  }
  EXPECT_LT(background_pieces_before_urgent, 64u);
}

}  // namespace
}  // namespace dd::kvpool
