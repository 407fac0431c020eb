#include "kv-pool/client/kv_store.h"

#include <vector>

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

TEST(InProcessKvStoreTest, WriteGatherRoundTripAndErrors) {
  auto store = NewInProcessKvStore();
  KvLayout layout{.n_layers = 2, .n_kv_heads = 3, .head_dim = 4, .chunk_tokens = 2};
  auto seq = store->Open(layout);
  ASSERT_TRUE(seq.ok());
  const int64_t bf = layout.block_floats();
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
    std::vector<float*> dsts = {b.data(), a.data()};
    auto s = store->GatherTo(*seq, refs, dsts, Priority::kBackground);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(store->Wait(*s).ok());
    EXPECT_EQ(b[0], 4.5f);
    EXPECT_EQ(a[bf - 1], 0.5f);
  }
  std::vector<float*> one = {dst.data()};
  EXPECT_EQ(store->GatherTo(*seq, refs, one, Priority::kUrgent).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Layout(*seq)->block_floats(), bf);
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

}  // namespace
}  // namespace dd::kvpool
