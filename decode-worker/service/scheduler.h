// Continuous batching over one Engine (docs/architecture.md; docs/decisions/0027-scheduler-and-admission.md).
//
// One thread owns the engine. Each iteration it admits waiting requests into free slots (as
// far as device memory allows), runs one decode step for every request that has a token to
// append, then spends the rest of a per-iteration token budget on chunked prefill of the
// requests still reading their prompts. Requests of one tenant are admitted and prefilled in
// arrival order; between API tenants, the tenant with the fewest requests in the batch goes
// first (its prompts read alone; otherwise prompt passes are short), and no tenant takes more
// than tenant_max_slots slots, so one tenant's flood of long prompts cannot hold another's
// first token behind it. Requests join and leave between iterations.
// Output goes to each request's RequestStream, which the RPC thread drains; cancellation and
// deadlines free the slot, its device-memory reservation and (sparse modes) its pool blocks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "decode-worker/engine/engine.h"

namespace dd::worker {

using Clock = std::chrono::steady_clock;

struct RequestSpec {
  std::string id;
  std::vector<int32_t> prompt;         // tokenized prompt, resumed tokens appended
  std::vector<int32_t> resumed;        // tokens the client already has (resume), also in prompt
  std::string tenant;                  // the API tenant the router authenticated ("": none)
  int32_t tenants = 0;                 // API tenants the router serves (SubmitRequest.tenants)
  uint64_t prefix_salt = 0;            // its tenant's prefix-reuse salt (kvpool::TenantSalt)
  int64_t resumed_text_bytes = 0;
  int64_t max_new_tokens = 128;        // counting the resumed tokens
  engine::SamplingParams sampling{};
  std::vector<std::string> stop_strings{};
  std::vector<int32_t> stop_ids{};
  bool stop_at_eos = true;
  Clock::time_point arrival = Clock::now();  // for TTFT
  Clock::time_point deadline = Clock::time_point::max();
};

struct StreamEvent {
  std::vector<int32_t> tokens{};
  int64_t first_index = 0;
  std::string text{};
  bool final = false;
  absl::Status status{};      // final: how the request ended
  std::string stop_reason{};  // final, ok
  int64_t prompt_tokens = 0, completion_tokens = 0, prefix_reused_tokens = 0;
  double ttft_s = 0, tpot_s = 0, hit_rate = 0;
  // final: KV bytes the request moved (sparse modes), and the device bytes its KV takes at its
  // final length in this mode and in full attention.
  int64_t kv_prefetch_bytes = 0, kv_urgent_bytes = 0, kv_wasted_bytes = 0;
  int64_t kv_device_bytes = 0, full_kv_device_bytes = 0;
  // final, key reconstruction: chunks whose keys were rebuilt, key bytes not moved for it; and
  // the device bytes of its landmarks and low-rank key caches at its final length.
  int64_t kv_reconstructed_chunks = 0, kv_key_bytes_saved = 0;
  int64_t landmark_device_bytes = 0, low_rank_key_device_bytes = 0;
};

// Scheduler → RPC thread. Thread-safe.
class RequestStream {
 public:
  void Push(StreamEvent e);
  // Waits up to `timeout` for events; returns those pending (empty on timeout).
  std::vector<StreamEvent> Wait(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
};

struct SchedulerOptions {
  int32_t max_batch = 16;        // requests in the batch at once (slots)
  int32_t max_waiting = 32;      // queued beyond that; more → RESOURCE_EXHAUSTED
  int64_t step_tokens = 512;     // tokens per iteration: decode rows plus prefill rows
  int64_t min_prefill_tokens = 64;  // prefill progress per iteration even under a full batch
  // Prompt tokens read per iteration while requests are decoding (decode first: each of their
  // tokens waits for one such pass); 0 = step_tokens less the decode rows. With nothing
  // decoding, a pass reads step_tokens. Between API tenants the tenant passes rule instead.
  // The default: docs/decisions/0046-prefill-budget-while-decoding.md.
  int64_t decode_prefill_tokens = 256;
  int64_t max_new_tokens_limit = 8192;  // the largest max_new_tokens a request may ask for
  // When the KV pool is lost mid-request, the worker waits this long for it to come back
  // (reconnecting at the same address) and then rebuilds each request's KV from its prompt and
  // the tokens it has streamed, as a resume does (Scheduler::PrefillPrompt); the stream
  // continues as if nothing happened (greedy: the same tokens). Past this, or after
  // `max_rebuilds` per request, the request fails with UNAVAILABLE (the router resumes it
  // elsewhere).
  std::chrono::milliseconds pool_recovery_timeout{30000};
  int32_t max_rebuilds = 3;
  // KV-store bytes the requests of one API tenant (RequestSpec::tenant, not "") may hold at
  // once, running and queued, counted as Engine::StoreBytes at admission: one tenant cannot
  // fill the pool quota every tenant behind this worker shares. -1: half of the store's
  // capacity when it has one (a pool tenant's quota), else no limit; 0: no limit.
  int64_t tenant_max_store_bytes = -1;
  // Batch slots the requests of one API tenant may hold when the router serves two or more
  // tenants: the rest stay free for the others, who then start at once instead of waiting for
  // that tenant's requests to finish. -1: max_batch − max(1, max_batch / 4); 0: no limit.
  int32_t tenant_max_slots = -1;
  // Device bytes (the memory plan's steady bytes of its requests) one API tenant may hold when
  // the router serves two or more tenants and --device_memory is set: the rest of the KV room
  // stays for the others. -1: three quarters of the budget left by weights and workspace;
  // 0: no limit.
  int64_t tenant_max_device_bytes = -1;
};

struct SchedulerStats {
  int32_t active = 0, waiting = 0;  // derived from the queues when Stats() copies them out
  int64_t active_tokens = 0;
  int64_t reserved_bytes = 0, kv_bytes = 0, free_bytes = -1;  // free: -1 = unlimited budget
  int64_t decode_tokens = 0, prefill_tokens = 0, steps = 0;
  int64_t finished = 0, cancelled = 0, failed = 0;
  int64_t rebuilt = 0;  // requests whose KV was rebuilt after the pool was lost
  double hit_rate = 0;
  int64_t transfer_wait_ns = 0;
  int64_t spec_resyncs = 0;  // dualdecoder: Engine::spec_resyncs()
  int64_t kv_prefetch_bytes = 0, kv_urgent_bytes = 0, kv_wasted_bytes = 0;  // sparse modes
  int64_t kv_key_bytes_saved = 0;       // key reconstruction: key bytes not moved
  int32_t reconstructing_layers = 0;    // key reconstruction: layers rebuilding keys at the last step
  std::vector<engine::KvLayerStats> kv_layers;  // sparse modes: per model layer
};

// Callbacks for metrics, run on the scheduler thread.
struct SchedulerObserver {
  virtual ~SchedulerObserver() = default;
  virtual void OnStep(bool decode, int rows, int64_t tokens, double seconds) {}
  virtual void OnFirstToken(double ttft_s) {}
  virtual void OnFinished(const StreamEvent& final_event) {}
};

class Scheduler {
 public:
  Scheduler(engine::Engine& engine, const SchedulerOptions& options, SchedulerObserver* observer = nullptr);
  ~Scheduler();  // stops the thread; requests still running end with UNAVAILABLE

  // Validates and queues a request. INVALID_ARGUMENT names the field; RESOURCE_EXHAUSTED when
  // the queue is full or the request cannot fit in device memory even alone.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(RequestSpec spec);
  // Ends a request (CANCELLED) and frees its state before the next iteration. False if unknown.
  bool Cancel(const std::string& id);
  SchedulerStats Stats() const;
  // Other threads may use only the engine's construction-time accessors (config, tokenizer,
  // memory_plan, device_memory_bytes, ValidatePrompt, FitsAlone); the rest is the
  // scheduler thread's.
  const engine::Engine& engine() const { return engine_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Request {
    RequestSpec spec;
    std::shared_ptr<RequestStream> stream;
    std::optional<engine::Sampler> sampler;
    std::optional<engine::TextStream> text;
    int32_t slot = -1;
    int64_t prefilled = 0;      // prompt tokens in the cache
    int32_t pending = -1;       // sampled (or replayed resumed) token to append at the next decode step
    int64_t generated = 0;      // output tokens so far, resumed ones included
    Clock::time_point first_token{}, last_token{};
    int64_t prefix_reused = 0;  // prompt tokens restored from the pool
    bool done = false;          // finished; Reap frees the slot, then sends final_event
    std::vector<int32_t> fresh;  // tokens streamed since the request last started prefilling
    bool lost = false;           // its KV went with a lost pool: RebuildLost builds it again
    Clock::time_point lost_at{};
    int32_t rebuilds = 0;
    int64_t rebuilt_tokens = 0;  // of spec.resumed, those a rebuild added (generated here)
    int64_t store_bytes = 0;     // charged to its tenant at Submit (Engine::StoreBytes)
    int64_t device_bytes = 0;    // the steady device bytes it was admitted for
    StreamEvent final_event{};
  };
  void Loop();
  void AdmitWaiting();
  int64_t DecodeIteration();            // returns the rows decoded
  void PrefillIteration(int64_t decoded);
  // The requests whose prompts the next prefill pass reads, in order, and the pass's token
  // budget: the tenant with the fewest requests in the batch first; between API tenants, an
  // under-served tenant's prompts alone, else short passes (scheduler.cc); with one tenant, at
  // most `cap` tokens (decode_prefill_tokens while requests decode).
  std::vector<Request*> PrefillCandidates(int64_t* budget, int64_t cap) const;
  void PublishStats();
  void PublishMemoryLocked();  // engine memory figures into stats_ (mu_ held, scheduler thread)
  // Tokens a request may grow to: its prompt plus what it may still generate, capped by the context.
  int64_t TotalTokens(const RequestSpec& spec) const;
  // The prompt tokens prefill computes. Sparse modes: the prompt without the resumed tokens.
  // The first run computed their KV in decode steps, attending sparsely once the context
  // outgrew the budget; a dense prefill would give them other KV and a greedy stream could
  // turn. Emit replays them as decode steps instead (one step each). Full mode: all of it.
  absl::Span<const int32_t> PrefillPrompt(const RequestSpec& spec) const;
  // Samples from `logits`, streams, and finishes the request when it stops; while resumed
  // tokens are left to replay (PrefillPrompt), queues the next instead, sampling nothing.
  void Emit(Request& r, const float* logits);
  void Finish(Request& r, absl::Status status, const std::string& stop_reason);
  void Fail(std::vector<Request*> reqs, const absl::Status& st);
  void Reap();  // removes finished/cancelled requests and frees their slots
  // Reconnects a lost KV pool and prefills the lost requests again (SchedulerOptions).
  void RebuildLost();
  // The stream of a resumed request that has nothing left to generate.
  std::shared_ptr<RequestStream> FinishedResume(const RequestSpec& spec, const std::string& stop);
  // The per-tenant store limit in force now (SchedulerOptions::tenant_max_store_bytes; 0: none).
  int64_t TenantStoreLimit() const;
  // Gives back what a request's admission charged to its tenant (mu_ held).
  void UnchargeLocked(const Request& r);
  // What each tenant holds in the batch (scheduler thread).
  struct TenantLoad {
    int32_t requests = 0;
    int64_t device_bytes = 0;  // the steady device bytes its requests were admitted for
  };
  std::map<std::string, TenantLoad> ActiveByTenant() const;
  // The waiting request to admit next: of the tenants below their slot and device-byte limits,
  // the one with the fewest requests in the batch, its oldest request; -1 when none may start
  // (mu_ held).
  int PickWaitingLocked(const std::map<std::string, TenantLoad>& active) const;
  // SchedulerOptions::tenant_max_device_bytes in force (0: none).
  int64_t TenantDeviceLimit() const;
  // The steady device bytes the memory plan gives a request.
  int64_t DeviceBytes(const RequestSpec& spec) const;

  engine::Engine& engine_;
  engine::MemoryPlan full_plan_;  // full attention's, for "device memory against full"
  SchedulerOptions options_;
  SchedulerObserver* observer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> waiting_;  // guarded by mu_
  std::vector<std::string> cancels_;              // guarded by mu_
  std::vector<std::string> active_ids_;           // guarded by mu_ (for Cancel)
  std::map<std::string, int64_t> tenant_store_bytes_;  // guarded by mu_: charged per API tenant
  bool stop_ = false;                             // guarded by mu_
  std::vector<std::unique_ptr<Request>> active_;  // scheduler thread only
  std::vector<int32_t> free_slots_;
  SchedulerStats stats_;                          // guarded by mu_ (copied out)
  std::thread thread_;
};

}  // namespace dd::worker
