#include "decode-worker/service/scheduler.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dd::worker {

void RequestStream::Push(StreamEvent e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

std::vector<StreamEvent> RequestStream::Wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return !events_.empty(); });
  std::vector<StreamEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

Scheduler::Scheduler(engine::Engine& engine, const SchedulerOptions& options, SchedulerObserver* observer)
    : engine_(engine),
      full_plan_(engine.model(), engine::DecodeMode::kFull, {}, 512, engine.options().kv_dtype),
      options_(options),
      observer_(observer) {
  options_.max_batch = std::max(1, options_.max_batch);
  options_.max_waiting = std::max(0, options_.max_waiting);
  options_.step_tokens = std::max<int64_t>(1, options_.step_tokens);
  options_.min_prefill_tokens = std::clamp<int64_t>(options_.min_prefill_tokens, 1, options_.step_tokens);
  for (int32_t s = options_.max_batch - 1; s >= 0; --s) free_slots_.push_back(s);
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

absl::StatusOr<std::shared_ptr<RequestStream>> Scheduler::Submit(RequestSpec spec) {
  const int64_t resumed = static_cast<int64_t>(spec.resumed.size());
  if (resumed > 0 && resumed <= static_cast<int64_t>(spec.prompt.size())) {
    // A resume of a request that had already produced all it could (its worker died between
    // the last token and the end of the stream): end it here, with any text still owed.
    const int64_t original = static_cast<int64_t>(spec.prompt.size()) - resumed;
    RETURN_IF_ERROR(engine_.ValidatePrompt(absl::MakeConstSpan(spec.prompt).first(original)));
    std::string stop;
    if (resumed >= spec.max_new_tokens) stop = "max_tokens";
    else if (static_cast<int64_t>(spec.prompt.size()) >= engine_.config().n_ctx_train) stop = "context_full";
    if (!stop.empty()) return FinishedResume(spec, stop);
  }
  RETURN_IF_ERROR(engine_.ValidatePrompt(spec.prompt));
  RETURN_IF_ERROR(spec.sampling.Validate());
  if (spec.max_new_tokens <= resumed) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens must be > 0 and above the ", resumed,
                                                   " resumed tokens, got ", spec.max_new_tokens));
  }
  const int64_t n = static_cast<int64_t>(spec.prompt.size());
  RETURN_IF_ERROR(engine_.FitsAlone(n, TotalTokens(spec)));
  const int64_t store_bytes = spec.tenant.empty() ? 0 : engine_.StoreBytes(n, TotalTokens(spec));
  const int64_t tenant_limit = TenantStoreLimit();
  auto r = std::make_unique<Request>();
  r->store_bytes = store_bytes;
  r->spec = std::move(spec);
  r->stream = std::make_shared<RequestStream>();
  std::shared_ptr<RequestStream> stream = r->stream;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return absl::UnavailableError("worker is shutting down");
    bool dup = std::find(active_ids_.begin(), active_ids_.end(), r->spec.id) != active_ids_.end();
    for (const auto& w : waiting_) dup |= w->spec.id == r->spec.id;
    if (dup) return absl::AlreadyExistsError(absl::StrCat("request ", r->spec.id, " is already running here"));
    const int64_t held = static_cast<int64_t>(active_ids_.size() + waiting_.size());
    if (held >= options_.max_batch + options_.max_waiting) {
      return absl::ResourceExhaustedError(absl::StrCat("worker is full: ", active_ids_.size(), " requests in the batch and ",
                                                       waiting_.size(), " waiting (max_batch ", options_.max_batch,
                                                       ", max_waiting ", options_.max_waiting, ")"));
    }
    if (tenant_limit > 0 && store_bytes > 0) {
      const auto it = tenant_store_bytes_.find(r->spec.tenant);
      const int64_t held_bytes = it == tenant_store_bytes_.end() ? 0 : it->second;
      if (held_bytes + store_bytes > tenant_limit) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "tenant ", r->spec.tenant, " is at its KV-store limit on this worker (--tenant_max_pool_bytes ",
            MiB(tenant_limit), "): its requests hold ", MiB(held_bytes), " and this one needs ", MiB(store_bytes)));
      }
      tenant_store_bytes_[r->spec.tenant] = held_bytes + store_bytes;
    } else {
      r->store_bytes = 0;  // nothing charged, nothing to give back
    }
    waiting_.push_back(std::move(r));
  }
  cv_.notify_all();
  return stream;
}

std::shared_ptr<RequestStream> Scheduler::FinishedResume(const RequestSpec& spec, const std::string& stop) {
  engine::TextStream text(engine_.tokenizer(), spec.stop_strings, spec.stop_ids, spec.stop_at_eos);
  text.Replay(spec.resumed, spec.resumed_text_bytes);
  text.Finish();
  const int64_t resumed = static_cast<int64_t>(spec.resumed.size());
  StreamEvent e{.first_index = resumed, .text = text.Delta(), .final = true};
  e.stop_reason = stop;
  e.prompt_tokens = static_cast<int64_t>(spec.prompt.size()) - resumed;
  e.completion_tokens = resumed;
  auto stream = std::make_shared<RequestStream>();
  stream->Push(std::move(e));
  return stream;
}

int64_t Scheduler::TenantStoreLimit() const {
  if (options_.tenant_max_store_bytes >= 0) return options_.tenant_max_store_bytes;
  return engine_.store_capacity_bytes() / 2;
}

void Scheduler::UnchargeLocked(const Request& r) {
  if (r.store_bytes <= 0) return;
  auto it = tenant_store_bytes_.find(r.spec.tenant);
  if (it == tenant_store_bytes_.end()) return;
  it->second -= r.store_bytes;
  if (it->second <= 0) tenant_store_bytes_.erase(it);
}

bool Scheduler::Cancel(const std::string& id) {
  bool known = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& w : waiting_) known |= w->spec.id == id;
    known |= std::find(active_ids_.begin(), active_ids_.end(), id) != active_ids_.end();
    if (known) cancels_.push_back(id);
  }
  cv_.notify_all();
  return known;
}

SchedulerStats Scheduler::Stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  SchedulerStats s = stats_;
  s.active = static_cast<int32_t>(active_ids_.size());
  s.waiting = static_cast<int32_t>(waiting_.size());
  return s;
}

int64_t Scheduler::TotalTokens(const RequestSpec& spec) const {
  const int64_t grow = spec.max_new_tokens - static_cast<int64_t>(spec.resumed.size());
  return std::min<int64_t>(engine_.config().n_ctx_train, static_cast<int64_t>(spec.prompt.size()) + grow);
}

absl::Span<const int32_t> Scheduler::PrefillPrompt(const RequestSpec& spec) const {
  const int64_t n = static_cast<int64_t>(spec.prompt.size());
  const int64_t original = n - static_cast<int64_t>(spec.resumed.size());
  // Full attention: a decode row's KV is a prefill row's, bit for bit, so prefilling the
  // resumed tokens too is exact (and one pass instead of a step each).
  if (!engine_.kv().selects_chunks() || original <= 0) return spec.prompt;
  return absl::MakeConstSpan(spec.prompt).first(original);
}

void Scheduler::PublishMemoryLocked() {
  stats_.reserved_bytes = engine_.reserved_bytes();
  stats_.kv_bytes = engine_.kv_bytes();
  stats_.free_bytes = engine_.free_device_bytes();
}

void Scheduler::Loop() {
  for (;;) {
    std::vector<std::string> cancels;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || !active_.empty() || !cancels_.empty(); });
      if (stop_) break;
      cancels.swap(cancels_);
      // Cancelled or expired before they got a slot.
      const Clock::time_point now = Clock::now();
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        Request& w = **it;
        const bool cancelled = std::find(cancels.begin(), cancels.end(), w.spec.id) != cancels.end();
        if (cancelled || now >= w.spec.deadline) {
          StreamEvent e{.final = true};
          e.status = cancelled ? absl::CancelledError("request cancelled")
                               : absl::DeadlineExceededError("deadline passed while the request waited for a slot");
          ++(cancelled ? stats_.cancelled : stats_.failed);
          if (observer_) observer_->OnFinished(e);
          w.stream->Push(std::move(e));
          UnchargeLocked(w);
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
    }
    const Clock::time_point now = Clock::now();
    for (auto& r : active_) {
      if (r->done) continue;
      if (std::find(cancels.begin(), cancels.end(), r->spec.id) != cancels.end()) {
        Finish(*r, absl::CancelledError("request cancelled"), "");
      } else if (now >= r->spec.deadline) {
        Finish(*r, absl::DeadlineExceededError("request deadline passed"), "");
      }
    }
    Reap();
    RebuildLost();
    AdmitWaiting();
    const int64_t decoded = DecodeIteration();
    Reap();
    PrefillIteration(decoded);
    Reap();
    PublishStats();
  }
  // Shutting down: nobody is left waiting for an answer that never comes.
  for (auto& r : active_) {
    if (!r->done) Finish(*r, absl::UnavailableError("worker is shutting down"), "");
  }
  Reap();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& w : waiting_) {
    StreamEvent e{.final = true};
    e.status = absl::UnavailableError("worker is shutting down");
    w->stream->Push(std::move(e));
    UnchargeLocked(*w);
  }
  waiting_.clear();
}

std::map<std::string, Scheduler::TenantLoad> Scheduler::ActiveByTenant() const {
  std::map<std::string, TenantLoad> load;
  for (const auto& r : active_) {  // finished ones hold their slot until Reap
    TenantLoad& t = load[r->spec.tenant];
    ++t.requests;
    t.device_bytes += r->device_bytes;
  }
  return load;
}

int64_t Scheduler::TenantDeviceLimit() const {
  if (options_.tenant_max_device_bytes >= 0) return options_.tenant_max_device_bytes;
  const int64_t budget = engine_.device_memory_bytes();
  if (budget <= 0) return 0;
  const engine::MemoryPlan& plan = engine_.memory_plan();
  return std::max<int64_t>(0, budget - plan.weight_bytes() - plan.shared_workspace_bytes()) / 4 * 3;
}

int Scheduler::PickWaitingLocked(const std::map<std::string, TenantLoad>& active) const {
  const int32_t slots = options_.tenant_max_slots >= 0 ? options_.tenant_max_slots
                                                       : options_.max_batch - std::max(1, options_.max_batch / 4);
  const int64_t bytes = TenantDeviceLimit();
  int best = -1;
  int32_t best_active = 0;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    const RequestSpec& spec = waiting_[i]->spec;
    const auto it = active.find(spec.tenant);
    const TenantLoad held = it == active.end() ? TenantLoad{} : it->second;
    if (spec.tenants >= 2 && !spec.tenant.empty()) {  // the others keep part of the batch and memory
      if (slots > 0 && held.requests >= slots) continue;
      if (bytes > 0 && held.requests > 0 && held.device_bytes + DeviceBytes(spec) > bytes) continue;
    }
    if (best < 0 || held.requests < best_active) best = static_cast<int>(i), best_active = held.requests;
  }
  return best;
}

int64_t Scheduler::DeviceBytes(const RequestSpec& spec) const {
  return engine_.memory_plan().Request(static_cast<int64_t>(spec.prompt.size()), TotalTokens(spec)).steady();
}

void Scheduler::AdmitWaiting() {
  while (!free_slots_.empty()) {
    Request* r = nullptr;
    int pick = -1;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (waiting_.empty()) return;
      pick = PickWaitingLocked(ActiveByTenant());
      if (pick < 0) return;  // every waiting tenant is at its slot limit
      r = waiting_[pick].get();  // only this thread removes from waiting_; others append
    }
    const int32_t slot = free_slots_.back();
    const RequestSpec& spec = r->spec;
    const int64_t n = static_cast<int64_t>(spec.prompt.size());
    const int64_t resumed = static_cast<int64_t>(spec.resumed.size());
    absl::Status st = engine_.Admit(slot, n, TotalTokens(spec));
    // Device memory full: wait for a running request to leave (no overtaking).
    if (absl::IsResourceExhausted(st) && !active_.empty()) return;
    absl::StatusOr<int64_t> started = st.ok() ? engine_.StartPrefill(slot, PrefillPrompt(spec), spec.prefix_salt) : absl::StatusOr<int64_t>(st);
    // The KV pool is lost (nothing running noticed yet; admission opens the request's store
    // sequence, so it may be the first to find out): the request waits for it as running ones
    // do, and RebuildLost starts it once the pool is back.
    const bool wait_for_pool = absl::IsUnavailable(started.status()) && options_.max_rebuilds > 0;
    std::unique_ptr<Request> owned;
    {
      std::lock_guard<std::mutex> lk(mu_);
      owned = std::move(waiting_[pick]);
      waiting_.erase(waiting_.begin() + pick);
      if (started.ok() || wait_for_pool) {
        active_ids_.push_back(owned->spec.id);
      } else {
        UnchargeLocked(*owned);
      }
    }
    if (wait_for_pool) {
      started = 0;
      owned->lost = true;
      owned->lost_at = Clock::now();
    }
    if (!started.ok()) {
      engine_.Release(slot);
      {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.failed;
      }
      StreamEvent e{.final = true};
      e.status = started.status();
      if (observer_) observer_->OnFinished(e);
      owned->stream->Push(std::move(e));
      continue;
    }
    free_slots_.pop_back();
    owned->slot = slot;
    owned->device_bytes = DeviceBytes(spec);
    owned->prefilled = *started;
    owned->prefix_reused = *started;
    // A resumed request continues with a seed of its own, so it does not replay the samples
    // of its first life.
    engine::SamplingParams sampling = spec.sampling;
    sampling.seed += static_cast<uint64_t>(resumed) * 0x9E3779B97F4A7C15ULL;
    owned->sampler.emplace(sampling);
    // The penalties count the prompt (repetition) and what was generated before a resume.
    owned->sampler->SetPrompt(absl::MakeConstSpan(spec.prompt).first(spec.prompt.size() - spec.resumed.size()));
    for (int32_t t : spec.resumed) owned->sampler->Accept(t);
    owned->text.emplace(engine_.tokenizer(), spec.stop_strings, spec.stop_ids, spec.stop_at_eos);
    owned->text->Replay(spec.resumed, spec.resumed_text_bytes);
    owned->generated = resumed;
    active_.push_back(std::move(owned));
  }
}

int64_t Scheduler::DecodeIteration() {
  std::vector<int32_t> seqs, tokens;
  std::vector<Request*> reqs;
  for (auto& r : active_) {
    if (r->done || r->lost || r->pending < 0) continue;
    seqs.push_back(r->slot);
    tokens.push_back(r->pending);
    reqs.push_back(r.get());
  }
  if (reqs.empty()) return 0;
  const Clock::time_point t0 = Clock::now();
  std::vector<float> logits;
  if (absl::Status st = engine_.DecodeStep(seqs, tokens, &logits); !st.ok()) {
    Fail(reqs, st);
    return 0;
  }
  const int64_t V = engine_.config().n_vocab;
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i]->pending = -1;
    Emit(*reqs[i], logits.data() + i * V);
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  if (observer_) observer_->OnStep(/*decode=*/true, static_cast<int>(reqs.size()), static_cast<int64_t>(reqs.size()), dt);
  std::lock_guard<std::mutex> lk(mu_);
  stats_.decode_tokens += static_cast<int64_t>(reqs.size());
  ++stats_.steps;
  return static_cast<int64_t>(reqs.size());
}

std::vector<Scheduler::Request*> Scheduler::PrefillCandidates(int64_t* budget, int64_t cap) const {
  std::vector<Request*> order;
  for (const auto& r : active_) {
    if (!r->done && !r->lost && r->prefilled < static_cast<int64_t>(PrefillPrompt(r->spec).size())) {
      order.push_back(r.get());
    }
  }
  if (order.empty()) return order;
  // The prompts of the tenants with the fewest requests in the batch first (a stable sort:
  // arrival order within a tenant, and among tenants as loaded).
  const std::map<std::string, TenantLoad> load = ActiveByTenant();
  std::stable_sort(order.begin(), order.end(), [&load](const Request* a, const Request* b) {
    return load.at(a->spec.tenant).requests < load.at(b->spec.tenant).requests;
  });
  bool shared = false;  // the router serves two or more API tenants
  for (const Request* r : order) shared |= r->spec.tenants >= 2 && !r->spec.tenant.empty();
  if (!shared) {
    *budget = std::min(*budget, cap);
    return order;
  }
  // A tenant with fewer requests in the batch than another has its prompts read alone, with the
  // whole budget, until they are in; otherwise passes take a quarter of the budget, so a newly
  // arrived tenant's prompt waits for at most a short pass before its own (measured: the
  // heavier tenant's prompts are read as fast in pieces of ~128 tokens, and its streams get
  // decode steps more often).
  int32_t heaviest = 0;
  for (const auto& [tenant, t] : load) heaviest = std::max(heaviest, t.requests);
  const std::string& lead = order.front()->spec.tenant;
  if (load.at(lead).requests < heaviest) {
    order.erase(std::remove_if(order.begin(), order.end(), [&lead](const Request* r) { return r->spec.tenant != lead; }),
                order.end());
  } else {
    *budget = std::max(options_.min_prefill_tokens, *budget / 4);
  }
  return order;
}

void Scheduler::PrefillIteration(int64_t decoded) {
  int64_t budget = std::max(options_.step_tokens - decoded, options_.min_prefill_tokens);
  // Decode first: while requests decode, a short pass (between tenants, PrefillCandidates
  // sets the passes instead).
  const int64_t cap = decoded > 0 && options_.decode_prefill_tokens > 0 ? options_.decode_prefill_tokens : budget;
  std::vector<engine::Engine::PrefillPiece> pieces;
  std::vector<Request*> reqs;
  for (Request* r : PrefillCandidates(&budget, cap)) {
    const absl::Span<const int32_t> prompt = PrefillPrompt(r->spec);
    const int64_t take = std::min(budget, static_cast<int64_t>(prompt.size()) - r->prefilled);
    pieces.push_back({.seq = r->slot, .prompt = prompt, .begin = r->prefilled, .end = r->prefilled + take});
    reqs.push_back(r);
    budget -= take;
    if (budget <= 0) break;
  }
  if (pieces.empty()) return;
  const Clock::time_point t0 = Clock::now();
  std::vector<std::vector<float>> last;
  if (absl::Status st = engine_.PrefillParts(pieces, &last); !st.ok()) {
    Fail(reqs, st);
    return;
  }
  int64_t tokens = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    reqs[i]->prefilled = pieces[i].end;
    tokens += pieces[i].end - pieces[i].begin;
    if (!last[i].empty()) Emit(*reqs[i], last[i].data());
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  if (observer_) observer_->OnStep(/*decode=*/false, static_cast<int>(pieces.size()), tokens, dt);
  std::lock_guard<std::mutex> lk(mu_);
  stats_.prefill_tokens += tokens;
}

void Scheduler::Emit(Request& r, const float* logits) {
  // Tokens of the prompt that prefill left out (PrefillPrompt: ones generated before a resume
  // or rebuild) go in as decode steps, one per step, each forced and its output unused, so
  // their KV is what decode computed when they were generated. The client has them already:
  // nothing is sampled or streamed until the last one's step.
  if (const int64_t length = engine_.Length(r.slot); length < static_cast<int64_t>(r.spec.prompt.size())) {
    r.pending = r.spec.prompt[length];
    return;
  }
  const int32_t token = r.sampler->Sample(logits, engine_.config().n_vocab);
  const Clock::time_point now = Clock::now();
  // The first token of this request on this worker (tokens a rebuild put back in the prompt
  // were generated here: they do not count as resumed).
  const bool first = r.generated == static_cast<int64_t>(r.spec.resumed.size()) - r.rebuilt_tokens;
  if (first) {
    r.first_token = now;
    if (observer_) observer_->OnFirstToken(std::chrono::duration<double>(now - r.spec.arrival).count());
  }
  r.last_token = now;
  StreamEvent e;
  e.first_index = r.generated;
  std::string stop = r.text->Push(token);
  if (stop.empty()) {
    e.tokens.push_back(token);
    r.fresh.push_back(token);
    ++r.generated;
    if (r.generated >= r.spec.max_new_tokens) {
      stop = "max_tokens";
    } else if (engine_.Length(r.slot) >= engine_.config().n_ctx_train) {
      stop = "context_full";
    } else {
      r.pending = token;
    }
  }
  if (!stop.empty()) r.text->Finish();
  e.text = r.text->Delta();
  // Text a stop releases with no token of its own (held back while it could have begun a stop
  // string) goes out with the final message: a text-only message would share its index with the
  // client's last token message, and a reconnect at that index could not tell whether the
  // client has it (docs/decisions/0050-resumable-streams.md).
  const bool tail_only = !stop.empty() && e.tokens.empty();
  if (!tail_only && (!e.tokens.empty() || !e.text.empty())) r.stream->Push(std::move(e));
  if (!stop.empty()) {
    Finish(r, absl::OkStatus(), stop);
    if (tail_only) r.final_event.text = std::move(e.text);
  }
}

void Scheduler::Finish(Request& r, absl::Status status, const std::string& stop_reason) {
  const int64_t resumed = static_cast<int64_t>(r.spec.resumed.size());
  StreamEvent e{.first_index = r.generated, .final = true};
  e.status = std::move(status);
  e.stop_reason = stop_reason;
  e.prompt_tokens = static_cast<int64_t>(r.spec.prompt.size()) - resumed;
  e.completion_tokens = r.generated;
  e.prefix_reused_tokens = r.prefix_reused;
  const int64_t fresh = r.generated - (resumed - r.rebuilt_tokens);
  if (fresh > 0) {
    e.ttft_s = std::chrono::duration<double>(r.first_token - r.spec.arrival).count();
    if (fresh > 1) e.tpot_s = std::chrono::duration<double>(r.last_token - r.first_token).count() / (fresh - 1);
  }
  // The request's own hit rate (its slot is still held here: Reap frees it).
  if (const engine::KvCache& kv = engine_.kv(); kv.selects_chunks() && r.slot >= 0) {
    e.hit_rate = kv.SeqHitRate(r.slot);
    const engine::SparseKvCache::SeqKvBytes moved = kv.SeqTransfers(r.slot);
    e.kv_prefetch_bytes = moved.prefetched;
    e.kv_urgent_bytes = moved.urgent;
    e.kv_wasted_bytes = moved.wasted;
    if (const engine::SeqKvCounts* c = kv.SeqCounts(r.slot); c != nullptr) {
      e.kv_reconstructed_chunks = c->reconstructed;
      e.kv_key_bytes_saved = (c->urgent_values + c->prefetched_values) * (kv.block_bytes() / 2);
    }
  }
  const int64_t length = static_cast<int64_t>(r.spec.prompt.size()) + r.generated - resumed;
  const engine::KvBytes aux = engine_.memory_plan().DecodeKv(length);
  e.landmark_device_bytes = aux.landmarks;
  e.low_rank_key_device_bytes = aux.low_rank;
  e.kv_device_bytes = engine_.memory_plan().DecodeKvBytes(length);
  e.full_kv_device_bytes = full_plan_.DecodeKvBytes(length);
  if (observer_) observer_->OnFinished(e);
  r.final_event = std::move(e);  // sent by Reap once the request's state is freed
  r.done = true;
}

void Scheduler::Fail(std::vector<Request*> reqs, const absl::Status& st) {
  LOG(ERROR) << "engine step failed for " << reqs.size() << " requests: " << st;
  for (Request* r : reqs) {
    // The KV pool went away: keep the request, rebuild its KV once the pool is back.
    if (absl::IsUnavailable(st) && !r->done && r->rebuilds < options_.max_rebuilds) {
      if (!r->lost) r->lost_at = Clock::now();
      r->lost = true;
      continue;
    }
    // Running out of pool or device memory stays RESOURCE_EXHAUSTED (the router may place the
    // request elsewhere); anything else is an internal failure of this worker.
    const absl::StatusCode code = absl::IsResourceExhausted(st) ? st.code() : absl::StatusCode::kInternal;
    if (!r->done) Finish(*r, absl::Status(code, absl::StrCat("engine step failed: ", st.message())), "");
  }
}

void Scheduler::RebuildLost() {
  bool any = false;
  for (auto& r : active_) any |= !r->done && r->lost;
  if (!any) return;
  // The pool held every running request's KV, not only the ones whose step failed: all of
  // them are rebuilt.
  std::vector<Request*> lost;
  for (auto& r : active_) {
    if (r->done) continue;
    if (!r->lost) r->lost_at = Clock::now();
    r->lost = true;
    lost.push_back(r.get());
  }
  // Every sequence of the lost connection goes before the store reconnects (idempotent).
  for (Request* r : lost) engine_.Release(r->slot);
  if (absl::Status st = engine_.RecoverKvStore(); !st.ok()) {
    const Clock::time_point now = Clock::now();
    for (Request* r : lost) {
      if (now - r->lost_at >= options_.pool_recovery_timeout) {
        Finish(*r, absl::UnavailableError(absl::StrCat("kv pool lost and not back within ",
                                                       options_.pool_recovery_timeout.count(), " ms: ", st.message())),
               "");
      }
    }
    // Nothing can decode meanwhile (every sparse sequence lived in that pool): don't spin.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return;
  }
  for (Request* r : lost) {
    // What the client has is now part of the prompt, exactly as for a resumed request.
    r->spec.prompt.insert(r->spec.prompt.end(), r->fresh.begin(), r->fresh.end());
    r->spec.resumed.insert(r->spec.resumed.end(), r->fresh.begin(), r->fresh.end());
    r->rebuilt_tokens += static_cast<int64_t>(r->fresh.size());
    r->fresh.clear();
    r->pending = -1;
    r->lost = false;
    ++r->rebuilds;
    // Sparse modes: the original prompt is prefilled and the generated tokens replayed as
    // decode steps (PrefillPrompt, Emit); a dense prefill of them would give them KV the first
    // run never had, and the stream could turn.
    const absl::Span<const int32_t> prefill = PrefillPrompt(r->spec);
    absl::Status st = engine_.Admit(r->slot, static_cast<int64_t>(prefill.size()), TotalTokens(r->spec));
    absl::StatusOr<int64_t> started =
        st.ok() ? engine_.StartPrefill(r->slot, prefill, r->spec.prefix_salt) : absl::StatusOr<int64_t>(st);
    if (!started.ok()) {
      Finish(*r, absl::UnavailableError(absl::StrCat("rebuilding the KV after the pool was lost: ",
                                                     started.status().message())),
             "");
      continue;
    }
    r->prefilled = *started;
    LOG(WARNING) << "request " << r->spec.id << ": KV pool lost; rebuilding " << r->spec.prompt.size()
                 << " tokens: " << prefill.size() << " prefilled, " << r->spec.prompt.size() - prefill.size()
                 << " replayed as decode steps (rebuild " << r->rebuilds << ")";
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.rebuilt;
  }
}

void Scheduler::Reap() {
  std::vector<std::unique_ptr<Request>> gone;
  for (auto it = active_.begin(); it != active_.end();) {
    if (!(*it)->done) {
      ++it;
      continue;
    }
    engine_.Release((*it)->slot);  // KV, reservation and (sparse) the pool sequence
    free_slots_.push_back((*it)->slot);
    gone.push_back(std::move(*it));
    it = active_.erase(it);
  }
  if (gone.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    PublishMemoryLocked();
    for (const auto& r : gone) {
      auto at = std::find(active_ids_.begin(), active_ids_.end(), r->spec.id);
      if (at != active_ids_.end()) active_ids_.erase(at);
      UnchargeLocked(*r);
      // A cancel that came in after this request ended must not hit a later one with its id.
      cancels_.erase(std::remove(cancels_.begin(), cancels_.end(), r->spec.id), cancels_.end());
      const absl::Status& st = r->final_event.status;
      if (st.ok()) ++stats_.finished;
      else if (absl::IsCancelled(st)) ++stats_.cancelled;
      else ++stats_.failed;
    }
  }
  // The client hears the end only after the state is gone (and the stats say so).
  for (auto& r : gone) r->stream->Push(std::move(r->final_event));
}

void Scheduler::PublishStats() {
  int64_t tokens = 0;
  for (const auto& r : active_) tokens += engine_.Length(r->slot);
  const engine::KvCache& kv = engine_.kv();
  std::lock_guard<std::mutex> lk(mu_);
  stats_.active_tokens = tokens;
  PublishMemoryLocked();
  stats_.hit_rate = kv.total_stats().hit_rate();
  stats_.transfer_wait_ns = engine_.transfer_wait_ns();
  stats_.spec_resyncs = engine_.spec_resyncs();
  if (kv.selects_chunks()) {
    const engine::KvLayerStats t = kv.total_stats();
    stats_.kv_prefetch_bytes = engine::MovedBytes(t.prefetched, t.prefetched_values, kv.block_bytes());
    stats_.kv_urgent_bytes = engine::MovedBytes(t.urgent, t.urgent_values, kv.block_bytes());
    stats_.kv_wasted_bytes = engine::MovedBytes(t.wasted, t.wasted_values, kv.block_bytes());
    stats_.kv_key_bytes_saved = (t.urgent_values + t.prefetched_values) * (kv.block_bytes() / 2);
    stats_.kv_layers = kv.layer_stats();
    stats_.reconstructing_layers = 0;
    for (size_t l = 0; l < stats_.kv_layers.size(); ++l) {
      stats_.reconstructing_layers += kv.key_reconstruction()->on(static_cast<int64_t>(l)) ? 1 : 0;
    }
  }
}

}  // namespace dd::worker
