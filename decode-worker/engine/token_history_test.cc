#include "decode-worker/engine/token_history.h"

#include <vector>

#include "gtest/gtest.h"

namespace dd::engine {
namespace {

TEST(TokenHistoryTest, ContinuationFollowsTheLatestEarlierPairElseToken) {
  TokenHistory h;
  // 5 6 7 ... 5 6 8 ... 5 6: the latest earlier (5, 6) is followed by 8, not 7.
  h.Note(0, std::vector<int32_t>{5, 6, 7, 1, 5, 6, 8, 2});
  h.Note(0, std::vector<int32_t>{5});
  EXPECT_EQ(h.Continuation(0), 6);  // (2, 5) never occurred: the latest earlier 5 was followed by 6
  h.Note(0, std::vector<int32_t>{6});
  EXPECT_EQ(h.Continuation(0), 8);
  EXPECT_EQ(h.size(0), 10);
  // (9, 6) never occurred: the latest earlier 6 (…5 6 9) was followed by 9, although an
  // older (x, 6) pair was followed by 8.
  h.Note(0, std::vector<int32_t>{9, 6});
  EXPECT_EQ(h.Continuation(0), 9);
  h.Note(0, std::vector<int32_t>{4});
  EXPECT_EQ(h.Continuation(0), -1);  // 4 never occurred before
}

TEST(TokenHistoryTest, ShortUnknownAndOverlappingSlots) {
  TokenHistory h;
  EXPECT_EQ(h.Continuation(3), -1);  // never noted
  EXPECT_EQ(h.Continuation(-1), -1);
  h.Note(-1, std::vector<int32_t>{1, 2, 3});  // ignored
  h.Note(1, std::vector<int32_t>{4, 4});
  EXPECT_EQ(h.Continuation(1), -1);  // two tokens: no earlier pair
  h.Note(1, std::vector<int32_t>{4});
  EXPECT_EQ(h.Continuation(1), 4);  // 4 4 4: the pair at 0-1 was followed by 4
  h.Note(1, std::vector<int32_t>{7, 4});
  EXPECT_EQ(h.Continuation(1), 7);  // 4 4 4 7 4: no earlier (7, 4); the latest earlier 4 was followed by 7
}

TEST(TokenHistoryTest, CopiesAreIndependentAndResetForgets) {
  TokenHistory h;
  h.Note(0, std::vector<int32_t>{1, 2, 3, 1, 2});
  h.Copy(0, 5);
  h.Note(5, std::vector<int32_t>{9});
  EXPECT_EQ(h.Continuation(0), 3);
  EXPECT_EQ(h.size(5), 6);
  EXPECT_EQ(h.Continuation(5), -1);  // (2, 9) is new in the copy
  h.Reset(0);
  EXPECT_EQ(h.size(0), 0);
  EXPECT_EQ(h.Continuation(0), -1);
  EXPECT_EQ(h.size(5), 6);
  h.Copy(5, 5);  // no-op
  EXPECT_EQ(h.size(5), 6);
}

}  // namespace
}  // namespace dd::engine
