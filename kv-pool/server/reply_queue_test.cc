#include "kv-pool/server/reply_queue.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

using Queue = ReplyQueue<std::string>;
using std::chrono::milliseconds;

const int kA = 0, kB = 0, kC = 0;  // their addresses name three endpoints
const void* const A = &kA;
const void* const B = &kB;
const void* const C = &kC;

// Sends what the queue allows at `now`; returns the items in order.
std::vector<std::string> Drain(Queue& q, Queue::Clock::time_point now, std::vector<uint64_t>* tickets = nullptr) {
  std::vector<std::string> out;
  while (auto r = q.Next(now)) {
    out.push_back(r->item);
    if (tickets != nullptr) tickets->push_back(r->ticket);
  }
  return out;
}

TEST(ReplyQueueTest, AtMostTheLimitInFlightAndEndpointsTakeTurns) {
  Queue q({.max_in_flight = 2, .per_endpoint_in_flight = 2, .per_endpoint_queued = 8});
  const auto t0 = Queue::Clock::now();
  for (const char* s : {"a1", "a2", "a3", "a4"}) ASSERT_TRUE(q.Push(A, s));
  ASSERT_TRUE(q.Push(B, "b1"));
  std::vector<uint64_t> tickets;
  // A was first; B's one reply goes before A's second.
  EXPECT_EQ(Drain(q, t0, &tickets), (std::vector<std::string>{"a1", "b1"}));
  EXPECT_EQ(q.in_flight(), 2u);
  EXPECT_EQ(q.queued(), 3u);
  q.Done(tickets[1]);
  EXPECT_EQ(Drain(q, t0, &tickets), (std::vector<std::string>{"a2"}));
  q.Done(tickets[0]);
  q.Done(tickets[2]);
  EXPECT_EQ(Drain(q, t0), (std::vector<std::string>{"a3", "a4"}));
  EXPECT_EQ(q.queued(), 0u);
}

TEST(ReplyQueueTest, OneEndpointHoldsAtMostItsShareAndItsQueueIsBounded) {
  Queue q({.max_in_flight = 4, .per_endpoint_in_flight = 1, .per_endpoint_queued = 2});
  const auto t0 = Queue::Clock::now();
  EXPECT_TRUE(q.Push(A, "a1"));
  EXPECT_TRUE(q.Push(A, "a2"));
  EXPECT_FALSE(q.Push(A, "a3"));  // full: refused, nothing queued
  EXPECT_TRUE(q.Push(C, "c1"));
  EXPECT_EQ(Drain(q, t0), (std::vector<std::string>{"a1", "c1"}));  // A's second waits for its first
  EXPECT_EQ(q.queued(), 1u);
  EXPECT_TRUE(q.Push(A, "a3"));  // room again once one left
}

TEST(ReplyQueueTest, AStalledEndpointStopsCountingAgainstOthersAfterTheStallTime) {
  Queue q({.max_in_flight = 2, .per_endpoint_in_flight = 2, .per_endpoint_queued = 8, .stall = milliseconds(500)});
  const auto t0 = Queue::Clock::now();
  for (const char* s : {"b1", "b2", "b3"}) ASSERT_TRUE(q.Push(B, s));
  EXPECT_EQ(Drain(q, t0), (std::vector<std::string>{"b1", "b2"}));  // B never takes them
  ASSERT_TRUE(q.Push(A, "a1"));
  EXPECT_EQ(Drain(q, t0 + milliseconds(499)), std::vector<std::string>{});  // still within the stall time
  // After it, A is served; B stays at its own limit of two in flight.
  EXPECT_EQ(Drain(q, t0 + milliseconds(501)), (std::vector<std::string>{"a1"}));
  EXPECT_EQ(q.queued(), 1u);
}

TEST(ReplyQueueTest, DoneForgetsAnUnknownTicket) {
  Queue q({});
  ASSERT_TRUE(q.Push(A, "a1"));
  auto r = q.Next(Queue::Clock::now());
  ASSERT_TRUE(r.has_value());
  q.Done(r->ticket + 100);  // not one of ours: no effect
  EXPECT_EQ(q.in_flight(), 1u);
  q.Done(r->ticket);
  q.Done(r->ticket);  // twice: no effect
  EXPECT_EQ(q.in_flight(), 0u);
}

// An owner (a tenant) whose replies hold copies in flight is held to its budget however many
// endpoints it uses: stalled replies keep counting against it (they keep their copies), its next
// ones wait, and another owner's go. One reply is always let through, however large.
TEST(ReplyQueueTest, AnOwnersCopiesInFlightStayWithinItsBudgetAcrossEndpoints) {
  Queue q({.max_in_flight = 2, .per_endpoint_in_flight = 1, .per_endpoint_queued = 8,
           .stall = milliseconds(500), .per_owner_bytes = 100});
  const auto t0 = Queue::Clock::now();
  constexpr int kBob = 1, kAlice = 2;
  ASSERT_TRUE(q.Push(A, "bob-a", {kBob, 60}));
  ASSERT_TRUE(q.Push(B, "bob-b", {kBob, 60}));
  ASSERT_TRUE(q.Push(C, "alice-c", {kAlice, 60}));
  std::vector<uint64_t> tickets;
  // Bob's second would take him to 120: it waits, and Alice's goes.
  EXPECT_EQ(Drain(q, t0, &tickets), (std::vector<std::string>{"bob-a", "alice-c"}));
  EXPECT_EQ(q.bytes_in_flight(), 120);
  // Long after the stall time Bob's first still holds its copy: his second still waits.
  EXPECT_EQ(Drain(q, t0 + milliseconds(5000)), std::vector<std::string>{});
  q.Done(tickets[0]);
  EXPECT_EQ(Drain(q, t0 + milliseconds(5000)), (std::vector<std::string>{"bob-b"}));
  EXPECT_EQ(q.bytes_in_flight(), 120);
  // A reply larger than the whole budget goes when its owner has nothing in flight.
  ASSERT_TRUE(q.Push(A, "alice-big", {kAlice, 500}));
  q.Done(tickets[1]);
  EXPECT_EQ(Drain(q, t0 + milliseconds(5000)), (std::vector<std::string>{"alice-big"}));
}

TEST(ReplyQueueTest, AnOwnersWaitingRepliesAreBoundedAcrossEndpoints) {
  Queue q({.max_in_flight = 0, .per_endpoint_queued = 8, .per_owner_queued = 10});
  EXPECT_TRUE(q.Push(A, "b1", {1, 0, 4}));
  EXPECT_TRUE(q.Push(B, "b2", {1, 0, 4}));
  EXPECT_FALSE(q.Push(C, "b3", {1, 0, 4}));  // 12 > 10, on any endpoint
  EXPECT_TRUE(q.Push(C, "b3", {1, 0, 2}));   // exactly 10
  EXPECT_TRUE(q.Push(A, "a1", {2, 0, 10}));  // another owner's still queue
  EXPECT_EQ(q.queued(), 4u);
}

}  // namespace
}  // namespace dd::kvpool
