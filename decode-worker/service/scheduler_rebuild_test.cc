// A request whose KV is built again from its prompt plus the tokens it already streamed (a
// router resume on another worker, or a rebuild after the worker's KV pool was lost) continues
// with exactly the tokens of an undisturbed run. In the sparse modes that holds only if the
// generated tokens' KV comes from decode steps, as in the first run (sparse attention once the
// context outgrows the budget), not from a dense prefill. SmolLM2: every layer is sparse.
#include <csignal>
#include <functional>

#include "decode-worker/engine/gemma_test_fixture.h"
#include "decode-worker/service/scheduler.h"
#include "gtest/gtest.h"
#include "kv-pool/server/pool_process.h"

namespace dd::worker {
namespace {

using engine::DecodeMode;
using kvpool::testing_util::kAlice;
using kvpool::testing_util::PoolProcess;

constexpr int64_t kNew = 40;

// Reads a stream to its end; `first`: the output index it starts at. `on_tokens` sees the count
// received so far after each event.
std::vector<int32_t> Collect(RequestStream& s, int64_t first, StreamEvent* final,
                             const std::function<void(size_t)>& on_tokens = nullptr) {
  std::vector<int32_t> tokens;
  for (;;) {
    for (StreamEvent& e : s.Wait(std::chrono::milliseconds(100))) {
      EXPECT_EQ(e.first_index, first + static_cast<int64_t>(tokens.size())) << "none repeated, none skipped";
      tokens.insert(tokens.end(), e.tokens.begin(), e.tokens.end());
      if (on_tokens) on_tokens(tokens.size());
      if (e.final) {
        *final = std::move(e);
        return tokens;
      }
    }
  }
}

class SchedulerRebuildTest : public engine::testing_util::SmolLM2Test {
 protected:
  // A small budget (64 tokens of top-k chunks, plus sinks and window) that a ~400-token prompt
  // outgrows: every decode step attends sparsely.
  static engine::EngineOptions Options(DecodeMode mode, const std::string& store = "inproc://") {
    engine::EngineOptions eo{.mode = mode, .kv_store = store, .kv_store_token = kAlice, .threads = 2};
    eo.sparse.budget_tokens = 64;
    return eo;
  }
  RequestSpec Spec(const std::string& id) {
    const std::vector<int32_t> text = Encode(engine::testing_util::LicenseText());
    RequestSpec s;
    s.id = id;
    s.prompt.assign(text.begin() + 200, text.begin() + 600);
    s.max_new_tokens = kNew;
    s.stop_at_eos = false;
    return s;
  }
  std::vector<int32_t> Undisturbed(DecodeMode mode) {
    auto eng = engine::Engine::Create(*model_, Options(mode));
    EXPECT_TRUE(eng.ok()) << eng.status();
    if (!eng.ok()) return {};
    Scheduler sched(**eng, {});
    StreamEvent end;
    std::vector<int32_t> tokens = Collect(**sched.Submit(Spec("whole")), 0, &end);
    EXPECT_TRUE(end.status.ok()) << end.status;
    EXPECT_EQ(tokens.size(), static_cast<size_t>(kNew));
    return tokens;
  }
};

// The router resumes the request on another worker with the tokens the client has.
TEST_F(SchedulerRebuildTest, ResumeInSparseModesGivesTheUndisturbedTokens) {
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    SCOPED_TRACE(std::string(engine::DecodeModeName(mode)));
    const std::vector<int32_t> whole = Undisturbed(mode);
    ASSERT_EQ(whole.size(), static_cast<size_t>(kNew));
    auto eng = engine::Engine::Create(*model_, Options(mode));
    ASSERT_TRUE(eng.ok());
    Scheduler sched(**eng, {});
    for (int64_t cut : {1, 6, 24}) {
      RequestSpec r = Spec("resumed-" + std::to_string(cut));
      r.resumed.assign(whole.begin(), whole.begin() + cut);
      r.prompt.insert(r.prompt.end(), r.resumed.begin(), r.resumed.end());
      r.resumed_text_bytes = static_cast<int64_t>((*eng)->tokenizer().Decode(r.resumed).size());
      StreamEvent end;
      std::vector<int32_t> joined = r.resumed, rest = Collect(**sched.Submit(r), cut, &end);
      ASSERT_TRUE(end.status.ok()) << end.status;
      joined.insert(joined.end(), rest.begin(), rest.end());
      EXPECT_EQ(joined, whole) << "resumed after " << cut << " tokens";
      EXPECT_EQ(end.completion_tokens, kNew);
      EXPECT_EQ(end.prompt_tokens, 400);
    }
  }
}

// The pool is SIGKILLed mid-stream and a new one starts at its address: the worker rebuilds the
// request's KV and the stream goes on with the undisturbed tokens.
TEST_F(SchedulerRebuildTest, PoolLossRebuildGivesTheUndisturbedTokens) {
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kDualDecoder}) {
    SCOPED_TRACE(std::string(engine::DecodeModeName(mode)));
    const std::vector<int32_t> whole = Undisturbed(mode);
    ASSERT_EQ(whole.size(), static_cast<size_t>(kNew));
    // A short lease: the store's renewal (a third of it) notices the lost pool within 100 ms.
    auto pool = std::make_unique<PoolProcess>(300, "1GiB");
    ASSERT_FALSE(pool->address().empty());
    const std::string address = pool->address();
    auto eng = engine::Engine::Create(*model_, Options(mode, "shm://" + address));
    ASSERT_TRUE(eng.ok()) << eng.status();
    Scheduler sched(**eng, {});
    StreamEvent end;
    bool killed = false;
    std::vector<int32_t> tokens = Collect(**sched.Submit(Spec("lost")), 0, &end, [&](size_t n) {
      if (n < 1 || killed) return;
      killed = true;
      pool->Kill(SIGKILL);
      pool = std::make_unique<PoolProcess>(300, "1GiB", std::vector<std::string>{"--listen=" + address});
      ASSERT_EQ(pool->address(), address);
    });
    ASSERT_TRUE(end.status.ok()) << end.status;
    EXPECT_EQ(tokens, whole);
    EXPECT_GE(sched.Stats().rebuilt, 1) << "the pool was lost while the request decoded";
  }
}

}  // namespace
}  // namespace dd::worker
