// The kept-stream log and its bounds (no processes; tests/serve/test_resume.py runs it for real).
#include "decode-worker/service/stream_keeper.h"

#include <thread>

#include "gtest/gtest.h"

namespace dd::worker {
namespace {

dd::v1::GenerateResponse Message(int first, int token) {
  dd::v1::GenerateResponse m;
  m.set_first_token_index(first);
  m.add_token_ids(token);
  return m;
}

TEST(KeptStreamTest, AReaderGetsEveryMessageInOrderThenTheEnd) {
  KeptStream s({});
  s.Append(Message(0, 11));
  dd::v1::GenerateResponse out;
  grpc::Status end;
  ASSERT_EQ(s.Wait(0, std::chrono::milliseconds(0), &out, &end), KeptStream::Next::kMessage);
  EXPECT_EQ(out.token_ids(0), 11);
  EXPECT_EQ(s.Wait(1, std::chrono::milliseconds(1), &out, &end), KeptStream::Next::kTimeout);
  // A message appended while a reader waits wakes it.
  std::thread writer([&] { s.Append(Message(1, 12)); });
  ASSERT_EQ(s.Wait(1, std::chrono::seconds(30), &out, &end), KeptStream::Next::kMessage);
  writer.join();
  EXPECT_EQ(out.first_token_index(), 1);
  s.Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "pool lost"));
  s.Finish(grpc::Status::OK);  // the first end holds
  ASSERT_EQ(s.Wait(2, std::chrono::milliseconds(0), &out, &end), KeptStream::Next::kEnd);
  EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_GT(s.bytes(), 0);
}

TEST(KeptStreamTest, WantedWhileReadAndForTheGraceAfter) {
  KeptStream s({});
  s.AddReader();
  EXPECT_TRUE(s.Wanted(std::chrono::milliseconds(0)));
  s.RemoveReader();
  EXPECT_FALSE(s.Wanted(std::chrono::milliseconds(0)));
  EXPECT_TRUE(s.Wanted(std::chrono::hours(1)));
}

TEST(StreamKeeperTest, StreamsAreKeptByTenantAndId) {
  StreamKeeper keeper(std::chrono::hours(1), 8);
  auto a = std::make_shared<KeptStream>(dd::worker::v1::SubmitRequest());
  keeper.Keep("team-a", "id-1", a);
  EXPECT_EQ(keeper.Find("team-a", "id-1"), a);
  EXPECT_EQ(keeper.Find("team-b", "id-1"), nullptr) << "another tenant's id finds nothing";
  EXPECT_EQ(keeper.Find("team-a", "id-2"), nullptr);
  auto b = std::make_shared<KeptStream>(dd::worker::v1::SubmitRequest());
  keeper.Keep("team-a", "id-1", b);  // the same id again: reconnects find the newer one
  EXPECT_EQ(keeper.Find("team-a", "id-1"), b);
  keeper.Forget("team-a", "id-1", a.get());  // no longer the kept one: nothing happens
  EXPECT_EQ(keeper.Find("team-a", "id-1"), b);
  keeper.Forget("team-a", "id-1", b.get());
  EXPECT_EQ(keeper.kept(), 0u);
}

TEST(StreamKeeperTest, OverTheBoundTheOldestEndedStreamsGoAndRunningOnesStay) {
  StreamKeeper keeper(std::chrono::hours(1), 2);
  std::vector<std::shared_ptr<KeptStream>> s;
  for (int i = 0; i < 4; ++i) s.push_back(std::make_shared<KeptStream>(dd::worker::v1::SubmitRequest()));
  keeper.Keep("", "running", s[0]);
  keeper.Keep("", "ended-old", s[1]);
  s[1]->Finish(grpc::Status::OK);
  keeper.Keep("", "ended-new", s[2]);
  s[2]->Finish(grpc::Status::OK);
  keeper.Keep("", "another", s[3]);  // four kept, bound two: the two ended go, oldest first
  EXPECT_EQ(keeper.Find("", "ended-old"), nullptr);
  EXPECT_EQ(keeper.Find("", "ended-new"), nullptr);
  EXPECT_EQ(keeper.Find("", "running"), s[0]);
  EXPECT_EQ(keeper.Find("", "another"), s[3]);
}

TEST(StreamKeeperTest, NoGraceKeepsNothing) {
  EXPECT_FALSE(StreamKeeper(std::chrono::milliseconds(0), 8).enabled());
  EXPECT_TRUE(StreamKeeper(std::chrono::milliseconds(1), 8).enabled());
}

}  // namespace
}  // namespace dd::worker
