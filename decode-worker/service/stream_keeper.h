// Streams kept for a reconnect (docs/decisions/0050-resumable-streams.md). A request submitted
// with the client's own id (SubmitRequest.client_request_id) logs every message it produces;
// when its caller (a router) goes away it decodes on for a grace window, and any router may
// attach to it by API tenant and id and read it again from its first message. A stream nobody
// reads for the grace window is cancelled and forgotten, so a client that never comes back
// costs nothing after it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "proto/generate.pb.h"
#include "proto/worker.pb.h"

namespace dd::worker {

// One request's output as it was streamed, and who reads it. Thread-safe.
class KeptStream {
 public:
  using Clock = std::chrono::steady_clock;
  explicit KeptStream(dd::worker::v1::SubmitRequest submitted) : submitted_(std::move(submitted)) {}

  const dd::worker::v1::SubmitRequest& submitted() const { return submitted_; }
  void Append(const dd::v1::GenerateResponse& m);
  // The end: OK after the final message, else the error the request ended with.
  void Finish(const grpc::Status& status);

  enum class Next { kMessage, kTimeout, kEnd };
  // Message `i` (kMessage), none yet within `timeout` (kTimeout), or the log ended before `i`
  // (kEnd, with how it ended in *end).
  Next Wait(size_t i, std::chrono::milliseconds timeout, dd::v1::GenerateResponse* out, grpc::Status* end);

  // Readers: the Submit call while its caller is there, and every Attach call.
  void AddReader();
  void RemoveReader();
  // Someone reads, or the last reader left less than `grace` ago.
  bool Wanted(std::chrono::milliseconds grace) const;
  // Ended, and (when `grace` > 0) more than `grace` ago.
  bool EndedFor(std::chrono::milliseconds grace) const;
  int64_t bytes() const;

 private:
  const dd::worker::v1::SubmitRequest submitted_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<dd::v1::GenerateResponse> log_;
  bool ended_ = false;
  grpc::Status end_;
  int readers_ = 0;
  Clock::time_point left_at_ = Clock::now(), ended_at_{};
  int64_t bytes_ = 0;
};

// The kept streams of one worker, by (tenant, client request id). Thread-safe.
class StreamKeeper {
 public:
  // `grace` 0 keeps nothing. At most `max_kept` streams; ended ones go first, oldest first
  // (running ones are bounded by the scheduler's batch and queue).
  StreamKeeper(std::chrono::milliseconds grace, size_t max_kept) : grace_(grace), max_kept_(max_kept) {}
  std::chrono::milliseconds grace() const { return grace_; }
  bool enabled() const { return grace_.count() > 0; }

  // Keeps `s`; a stream kept before under the same key is forgotten (its reconnects now find
  // this one).
  void Keep(const std::string& tenant, const std::string& id, std::shared_ptr<KeptStream> s);
  std::shared_ptr<KeptStream> Find(const std::string& tenant, const std::string& id);
  // Forgets the stream under the key if it is still `s`.
  void Forget(const std::string& tenant, const std::string& id, const KeptStream* s);

  size_t kept() const;
  int64_t bytes() const;  // of the kept logs

 private:
  void Purge();  // mu_ held: drops ended streams past the grace, then the oldest ended over max_kept_
  const std::chrono::milliseconds grace_;
  const size_t max_kept_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<KeptStream>> streams_;
  std::deque<std::pair<std::string, std::string>> order_;  // keys by when they were kept
};

// --stream_grace_ms (default 30 s; 0 = streams die with their caller).
std::chrono::milliseconds StreamGraceFromFlags();

}  // namespace dd::worker
