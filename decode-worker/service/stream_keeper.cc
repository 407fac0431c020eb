#include "decode-worker/service/stream_keeper.h"

#include <algorithm>

#include "absl/flags/flag.h"

ABSL_FLAG(int64_t, stream_grace_ms, 30000,
          "How long a request submitted with the client's own request_id decodes on after its router or client "
          "went away, its output kept for a reconnect through any router (0 = it is cancelled at once)");

namespace dd::worker {

void KeptStream::Append(const dd::v1::GenerateResponse& m) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    log_.push_back(m);
    bytes_ += static_cast<int64_t>(m.ByteSizeLong());
  }
  cv_.notify_all();
}

void KeptStream::Finish(const grpc::Status& status) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ended_) return;
    ended_ = true;
    end_ = status;
    ended_at_ = Clock::now();
  }
  cv_.notify_all();
}

KeptStream::Next KeptStream::Wait(size_t i, std::chrono::milliseconds timeout, dd::v1::GenerateResponse* out,
                                  grpc::Status* end) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return i < log_.size() || ended_; });
  if (i < log_.size()) {
    *out = log_[i];
    return Next::kMessage;
  }
  if (ended_) {
    *end = end_;
    return Next::kEnd;
  }
  return Next::kTimeout;
}

void KeptStream::AddReader() {
  std::lock_guard<std::mutex> lk(mu_);
  ++readers_;
}

void KeptStream::RemoveReader() {
  std::lock_guard<std::mutex> lk(mu_);
  if (--readers_ == 0) left_at_ = Clock::now();
}

bool KeptStream::Wanted(std::chrono::milliseconds grace) const {
  std::lock_guard<std::mutex> lk(mu_);
  return readers_ > 0 || Clock::now() - left_at_ < grace;
}

bool KeptStream::EndedFor(std::chrono::milliseconds grace) const {
  std::lock_guard<std::mutex> lk(mu_);
  return ended_ && Clock::now() - ended_at_ >= grace;
}

int64_t KeptStream::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

void StreamKeeper::Keep(const std::string& tenant, const std::string& id, std::shared_ptr<KeptStream> s) {
  std::lock_guard<std::mutex> lk(mu_);
  Purge();
  auto key = std::make_pair(tenant, id);
  if (streams_.find(key) == streams_.end()) order_.push_back(key);
  streams_[key] = std::move(s);
}

std::shared_ptr<KeptStream> StreamKeeper::Find(const std::string& tenant, const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  Purge();
  auto it = streams_.find({tenant, id});
  return it == streams_.end() ? nullptr : it->second;
}

void StreamKeeper::Forget(const std::string& tenant, const std::string& id, const KeptStream* s) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = streams_.find({tenant, id});
  if (it != streams_.end() && it->second.get() == s) streams_.erase(it);
  Purge();
}

void StreamKeeper::Purge() {
  for (auto it = streams_.begin(); it != streams_.end();) {
    it = it->second->EndedFor(grace_) ? streams_.erase(it) : std::next(it);
  }
  // Over the bound: the oldest ended streams go (a reconnect to them then finds nothing).
  for (auto k = order_.begin(); streams_.size() > max_kept_ && k != order_.end();) {
    auto it = streams_.find(*k);
    if (it != streams_.end() && it->second->EndedFor(std::chrono::milliseconds(0))) {
      streams_.erase(it);
      k = order_.erase(k);
    } else {
      ++k;
    }
  }
  // Keys whose streams are gone leave the order.
  order_.erase(std::remove_if(order_.begin(), order_.end(), [&](const auto& k) { return !streams_.count(k); }),
               order_.end());
}

size_t StreamKeeper::kept() const {
  std::lock_guard<std::mutex> lk(mu_);
  return streams_.size();
}

int64_t StreamKeeper::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t b = 0;
  for (const auto& [k, s] : streams_) b += s->bytes();
  return b;
}

std::chrono::milliseconds StreamGraceFromFlags() {
  return std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_stream_grace_ms)));
}

}  // namespace dd::worker
