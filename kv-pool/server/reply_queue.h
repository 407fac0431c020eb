// The order in which the pool's UCX thread sends replies that carry blocks (ucx_server.cc;
// docs/decisions/0022-ucx-replies.md). Over tcp, rendezvous replies in flight at once beyond two
// (or two on one endpoint) fell to less than half the throughput at times, so at most
// `max_in_flight` are sent at a time and the rest wait here (a packed reply is packed only when
// it leaves, so waiting ones hold no copy). Endpoints take turns, and one endpoint has at most
// `per_endpoint_in_flight` in flight and `per_endpoint_queued` waiting (beyond, Push refuses). A reply still in flight after
// `stall` stops counting against the shared limit: a worker that never takes its replies
// stalls only its own endpoint, not the other tenants'. Memory is bounded per owner (a tenant)
// too, whatever number of endpoints it opens: replies waiting of at most `per_owner_queued` in
// weight (the server weighs a reply by its blocks, which its waiting entry holds), and
// replies in flight (stalled ones included) holding at most `per_owner_bytes` of copies between
// them; beyond, an owner's replies wait (one is always let through). Not thread-safe (one
// progress thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace dd::kvpool {

template <typename Item>
class ReplyQueue {
 public:
  using Clock = std::chrono::steady_clock;
  using Endpoint = const void*;
  struct Limits {
    int max_in_flight = 2;
    int per_endpoint_in_flight = 1;
    size_t per_endpoint_queued = 256;
    Clock::duration stall = std::chrono::milliseconds(500);
    int64_t per_owner_bytes = INT64_MAX;
    size_t per_owner_queued = SIZE_MAX;  // in Cost::weight
  };
  // What a reply costs its owner: while it waits, `weight`; while it is in flight, the bytes of
  // its copy. owner < 0: nothing.
  struct Cost {
    int owner = -1;
    int64_t bytes = 0;
    size_t weight = 1;
  };
  struct Ready {
    Endpoint ep;
    Item item;
    uint64_t ticket;  // give it to Done when the send completes (or fails)
  };

  explicit ReplyQueue(Limits limits) : limits_(limits) {}

  // Queues `item` for `ep`; false (and nothing queued) when that endpoint's queue, or its
  // owner's, is full.
  bool Push(Endpoint ep, Item item, Cost cost = {}) {
    if (cost.owner >= 0) {
      auto o = owners_.find(cost.owner);
      if (o != owners_.end() && o->second.queued + cost.weight > limits_.per_owner_queued) return false;
    }
    auto [it, fresh] = eps_.try_emplace(ep);
    PerEndpoint& e = it->second;
    if (e.queued.size() >= limits_.per_endpoint_queued) {
      if (fresh) eps_.erase(it);
      return false;
    }
    if (e.queued.empty()) order_.push_back(ep);
    e.queued.push_back({std::move(item), cost});
    if (cost.owner >= 0) owners_[cost.owner].queued += cost.weight;
    ++queued_;
    return true;
  }

  // The next reply to send at `now` within the limits (endpoints in turn), or nullopt.
  std::optional<Ready> Next(Clock::time_point now) {
    if (queued_ == 0) return std::nullopt;
    int active = 0;
    for (const auto& [ticket, s] : sending_) active += now - s.start < limits_.stall ? 1 : 0;
    if (active >= limits_.max_in_flight) return std::nullopt;
    for (size_t tries = order_.size(); tries > 0; --tries) {
      const Endpoint ep = order_.front();
      order_.pop_front();
      PerEndpoint& e = eps_[ep];
      if (e.in_flight >= limits_.per_endpoint_in_flight || OverBudget(e.queued.front().cost)) {
        order_.push_back(ep);
        continue;
      }
      Waiting w = std::move(e.queued.front());
      e.queued.pop_front();
      --queued_;
      if (!e.queued.empty()) order_.push_back(ep);
      ++e.in_flight;
      if (w.cost.owner >= 0) {
        PerOwner& o = owners_[w.cost.owner];
        o.queued -= w.cost.weight;
        o.bytes += w.cost.bytes;
      }
      bytes_ += w.cost.bytes;
      Ready r{ep, std::move(w.item), next_ticket_++};
      sending_.emplace(r.ticket, Sending{ep, now, w.cost});
      return r;
    }
    return std::nullopt;
  }

  // The send behind `ticket` completed or failed.
  void Done(uint64_t ticket) {
    auto it = sending_.find(ticket);
    if (it == sending_.end()) return;
    auto e = eps_.find(it->second.ep);
    if (e != eps_.end() && --e->second.in_flight == 0 && e->second.queued.empty()) eps_.erase(e);
    const Cost cost = it->second.cost;
    if (cost.owner >= 0) {
      auto o = owners_.find(cost.owner);
      if (o != owners_.end() && (o->second.bytes -= cost.bytes) == 0 && o->second.queued == 0) owners_.erase(o);
    }
    bytes_ -= cost.bytes;
    sending_.erase(it);
  }

  size_t in_flight() const { return sending_.size(); }
  size_t queued() const { return queued_; }
  int64_t bytes_in_flight() const { return bytes_; }  // the copies replies in flight hold, all owners

 private:
  struct Waiting {
    Item item;
    Cost cost;
  };
  struct PerEndpoint {
    std::deque<Waiting> queued;
    int in_flight = 0;
  };
  struct PerOwner {
    size_t queued = 0;  // the weight of its replies waiting
    int64_t bytes = 0;  // held by its replies in flight
  };
  struct Sending {
    Endpoint ep;
    Clock::time_point start;
    Cost cost;
  };
  // Whether a reply of `cost` would take its owner past its budget (an owner with nothing in
  // flight may always send one, however large).
  bool OverBudget(const Cost& cost) const {
    if (cost.owner < 0 || cost.bytes == 0) return false;
    auto o = owners_.find(cost.owner);
    if (o == owners_.end() || o->second.bytes == 0) return false;
    return o->second.bytes > limits_.per_owner_bytes - cost.bytes;
  }
  Limits limits_;
  absl::flat_hash_map<Endpoint, PerEndpoint> eps_;
  std::deque<Endpoint> order_;  // endpoints with queued replies, in turn
  absl::flat_hash_map<uint64_t, Sending> sending_;
  absl::flat_hash_map<int, PerOwner> owners_;
  uint64_t next_ticket_ = 1;
  size_t queued_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace dd::kvpool
