#include "decode-worker/engine/resident_set.h"

#include <gtest/gtest.h>

namespace dd::engine {
namespace {

TEST(ResidentSetTest, AssignFillsEmptySlotsThenEvictsLeastRecentlyUsedOutsideKeep) {
  ResidentSet r;
  r.Init(/*heads=*/2, /*slots_per_head=*/3);
  std::vector<int32_t> slots;
  int64_t evicted = 0;
  ASSERT_TRUE(r.Assign(0, {10, 11, 12}, {10, 11, 12}, false, false, &slots, &evicted));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(evicted, 0);
  EXPECT_EQ(r.Find(0, 11), 1);
  EXPECT_EQ(r.Find(1, 11), -1);  // heads are independent
  r.Touch(0, 0, 5);
  r.Touch(0, 1, 3);
  r.Touch(0, 2, 4);
  // 11 (stamp 3) is the least recently used, but it is kept: 12 (stamp 4) goes.
  slots.clear();
  ASSERT_TRUE(r.Assign(0, {20}, {11, 20}, false, false, &slots, &evicted));
  EXPECT_EQ(slots, (std::vector<int32_t>{2}));
  EXPECT_EQ(evicted, 1);
  EXPECT_EQ(r.Find(0, 12), -1);
  EXPECT_EQ(r.Find(0, 20), 2);
  EXPECT_EQ(r.Find(0, 11), 1);
}

TEST(ResidentSetTest, RefusesWithoutChangesWhenTooFewSlots) {
  ResidentSet r;
  r.Init(1, 2);
  std::vector<int32_t> slots;
  int64_t evicted = 0;
  ASSERT_TRUE(r.Assign(0, {1, 2}, {1, 2}, false, false, &slots, &evicted));
  slots.clear();
  EXPECT_FALSE(r.Assign(0, {3, 4}, {1, 3, 4}, false, false, &slots, &evicted));
  EXPECT_TRUE(slots.empty());
  EXPECT_EQ(r.Find(0, 1), 0);
  EXPECT_EQ(r.Find(0, 2), 1);
  EXPECT_EQ(r.Available(0, {1, 3, 4}, false), 1);
}

TEST(ResidentSetTest, InFlightSlotsAreTakenOnlyWhenAllowedAndLandTogether) {
  ResidentSet r;
  r.Init(1, 2);
  std::vector<int32_t> slots;
  int64_t evicted = 0;
  ASSERT_TRUE(r.Assign(0, {7, 8}, {7, 8}, false, /*inflight=*/true, &slots, &evicted));
  EXPECT_TRUE(r.inflight(0, 0));
  EXPECT_EQ(r.Available(0, {}, /*allow_inflight=*/false), 0);
  EXPECT_EQ(r.Available(0, {}, /*allow_inflight=*/true), 2);
  slots.clear();
  EXPECT_FALSE(r.Assign(0, {9}, {9}, false, false, &slots, &evicted));
  r.Landed();
  EXPECT_FALSE(r.inflight(0, 0));
  ASSERT_TRUE(r.Assign(0, {9}, {8, 9}, false, false, &slots, &evicted));
  EXPECT_EQ(r.Find(0, 7), -1);
  EXPECT_EQ(r.Find(0, 9), 0);
}

TEST(ResidentSetTest, BlocksAreDistinctAndClearForgetsChunks) {
  ResidentSet r;
  r.Init(2, 2);
  EXPECT_EQ(r.blocks(), 4);
  EXPECT_EQ(r.BlockIndex(0, 1), 1);
  EXPECT_EQ(r.BlockIndex(1, 0), 2);
  std::vector<int32_t> slots;
  int64_t evicted = 0;
  ASSERT_TRUE(r.Assign(1, {3}, {3}, false, false, &slots, &evicted));
  r.Clear();
  EXPECT_EQ(r.Find(1, 3), -1);
  EXPECT_EQ(r.Available(1, {}, false), 2);
}

// A values-only landing leaves its slots without keys until they are rebuilt; Drop forgets a
// chunk, but never one a transfer is still writing; Clear and a whole landing mark the stored
// keys again.
TEST(ResidentSetTest, KeyStatesFollowTheLandingsAndDropForgetsTheChunk) {
  using KeyState = ResidentSet::KeyState;
  ResidentSet r;
  r.Init(1, 3);
  std::vector<int32_t> slots;
  int64_t evicted = 0;
  ASSERT_TRUE(r.Assign(0, {4, 5}, {4, 5}, false, false, &slots, &evicted, /*values_only=*/true));
  EXPECT_EQ(r.keys(0, slots[0]), KeyState::kMissing);
  r.set_keys(0, slots[0], KeyState::kRebuilt);
  EXPECT_EQ(r.keys(0, slots[0]), KeyState::kRebuilt);
  ASSERT_TRUE(r.Assign(0, {6}, {4, 5, 6}, false, /*inflight=*/true, &slots, &evicted));
  EXPECT_EQ(r.keys(0, slots[2]), KeyState::kStored);
  r.set_keys(0, slots[2], KeyState::kRebuilt);
  r.Drop(0, 6);  // in flight: kept
  EXPECT_EQ(r.Find(0, 6), slots[2]);
  r.Landed();
  r.Drop(0, 6);
  EXPECT_EQ(r.Find(0, 6), -1);
  EXPECT_EQ(r.Available(0, {4, 5}, false), 1);
  r.Drop(0, 42);  // not resident: nothing
  std::vector<int32_t> again;
  ASSERT_TRUE(r.Assign(0, {7}, {4, 5, 7}, false, false, &again, &evicted));
  EXPECT_EQ(again[0], slots[2]);  // the emptied slot first
  EXPECT_EQ(r.keys(0, again[0]), KeyState::kStored);
  r.Clear();
  EXPECT_EQ(r.keys(0, slots[0]), KeyState::kStored);
}

}  // namespace
}  // namespace dd::engine
