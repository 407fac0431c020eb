// Continuous batching on the real model: requests that share the batch, join mid-way and are
// prefilled in pieces between decode steps give exactly the tokens they give alone.
#include "decode-worker/service/scheduler.h"
#include "decode-worker/service/worker_service.h"

#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

#include <algorithm>
#include <thread>

namespace dd::worker {
namespace {

using engine::testing_util::GemmaTest;

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  StreamEvent final;
};

// Collects a stream to its end; `first` = the output index the stream starts at.
Outcome Drain(RequestStream& s, int64_t first = 0) {
  Outcome o;
  for (;;) {
    for (StreamEvent& e : s.Wait(std::chrono::milliseconds(100))) {
      EXPECT_EQ(e.first_index, first + static_cast<int64_t>(o.tokens.size())) << "tokens arrive in order, none skipped";
      o.tokens.insert(o.tokens.end(), e.tokens.begin(), e.tokens.end());
      o.text += e.text;
      if (e.final) {
        o.final = std::move(e);
        return o;
      }
    }
  }
}

class SchedulerTest : public GemmaTest {
 protected:
  RequestSpec Spec(const std::string& id, const std::string& text, int64_t max_new) {
    RequestSpec s;
    s.id = id;
    s.prompt = Encode(text);
    s.max_new_tokens = max_new;
    return s;
  }
  // `n` requests of tenant B (of two API tenants), each `prompt` and 200 tokens.
  std::vector<std::shared_ptr<RequestStream>> FloodOfB(Scheduler& sched, int n, const std::string& prompt) {
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int i = 0; i < n; ++i) {
      RequestSpec s = Spec("b" + std::to_string(i), prompt, 200);
      s.tenant = "team-b";
      s.tenants = 2;
      s.stop_at_eos = false;
      auto st = sched.Submit(s);
      EXPECT_TRUE(st.ok()) << st.status();
      if (st.ok()) streams.push_back(*st);
    }
    return streams;
  }
  // Polls (the scheduler admits on its own thread) until `n` requests are in the batch, or 30 s.
  static int WaitForActive(Scheduler& sched, int n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (sched.Stats().active < n && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    return sched.Stats().active;
  }
  std::vector<std::string> Prompts() {
    std::vector<std::string> p;
    for (int i = 0; i < 4; ++i) {
      std::string t = "Story " + std::to_string(i) + ": ";
      for (int k = 0; k < 10 + 12 * i; ++k) t += "the quick brown fox jumps over the lazy dog number " + std::to_string(k) + ". ";
      p.push_back(t + "In the end, the fox");
    }
    return p;
  }
};

// Every other request samples (seeded, with penalties): its tokens depend on its own logits and
// seed alone, so batched they are the solo run's.
engine::SamplingParams SamplingFor(size_t i) {
  if (i % 2 == 0) return {};
  return {.temperature = 1.0f, .top_p = 0.95f, .min_p = 0.02f, .repetition_penalty = 1.1f, .frequency_penalty = 0.3f,
          .seed = 100 + i};
}

TEST_F(SchedulerTest, BatchedRequestsMatchSoloGeneration) {
  for (engine::DecodeMode mode : {engine::DecodeMode::kFull, engine::DecodeMode::kDualDecoder}) {
    engine::EngineOptions eo{.mode = mode, .threads = 2};
    eo.sparse.budget_tokens = 64;
    auto solo = engine::Engine::Create(*model_, eo);
    ASSERT_TRUE(solo.ok()) << solo.status();
    std::vector<engine::GenerateResult> want;
    for (const std::string& p : Prompts()) {
      engine::GenerateOptions go;
      go.max_new_tokens = 12;
      go.stop_at_eos = false;
      go.sampling = SamplingFor(want.size());
      auto r = (*solo)->Generate(Encode(p), go, nullptr);
      ASSERT_TRUE(r.ok()) << r.status();
      want.push_back(*r);
    }
    auto eng = engine::Engine::Create(*model_, eo);
    ASSERT_TRUE(eng.ok());
    // A small step budget: long prompts are prefilled in pieces between other requests' steps.
    Scheduler sched(**eng, {.max_batch = 3, .max_waiting = 4, .step_tokens = 96, .min_prefill_tokens = 32});
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (size_t i = 0; i < want.size(); ++i) {
      RequestSpec s = Spec("r" + std::to_string(i), Prompts()[i], 12);
      s.stop_at_eos = false;
      s.sampling = SamplingFor(i);
      auto st = sched.Submit(std::move(s));
      ASSERT_TRUE(st.ok()) << st.status();
      streams.push_back(*st);
    }
    for (size_t i = 0; i < want.size(); ++i) {
      Outcome o = Drain(*streams[i]);
      ASSERT_TRUE(o.final.status.ok()) << o.final.status;
      EXPECT_EQ(o.tokens, want[i].tokens) << "request " << i << " mode " << engine::DecodeModeName(mode);
      EXPECT_EQ(o.text, want[i].text);
      EXPECT_EQ(o.final.stop_reason, "max_tokens");
    }
    SchedulerStats s = sched.Stats();
    EXPECT_EQ(s.finished, 4);
    EXPECT_GT(s.steps, 11);
  }
}

// The usage's prefetch_hit_rate is the request's own, first decode step excluded: for requests
// run one after another it is the change in the engine's counters across that request, without
// the pre-decoding-seeded step (where P' = S by construction), not the running total.
TEST_F(SchedulerTest, HitRateIsTheRequestsOwn) {
  engine::EngineOptions eo{.mode = engine::DecodeMode::kDualDecoder, .threads = 2};
  eo.sparse.budget_tokens = 64;
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok()) << eng.status();
  Scheduler sched(**eng, {});
  const engine::KvCache& sc = (*eng)->kv();
  for (int i : {3, 1}) {
    const auto before = sc.total_stats();
    RequestSpec s = Spec("h" + std::to_string(i), Prompts()[i], 16);
    s.stop_at_eos = false;
    Outcome o = Drain(**sched.Submit(std::move(s)));
    ASSERT_TRUE(o.final.status.ok()) << o.final.status;
    const auto after = sc.total_stats();
    const int64_t hits = (after.hits - after.seeded_hits) - (before.hits - before.seeded_hits);
    const int64_t denom = (after.predicted_for - after.seeded_for) - (before.predicted_for - before.seeded_for);
    ASSERT_GT(denom, 0);
    EXPECT_DOUBLE_EQ(o.final.hit_rate, static_cast<double>(hits) / denom) << "request " << i;
  }
}

TEST_F(SchedulerTest, ResumedRequestContinuesWithoutRepeats) {
  engine::EngineOptions eo{.threads = 2};
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok());
  Scheduler sched(**eng, {});
  RequestSpec s = Spec("full", Prompts()[0], 10);
  s.stop_at_eos = false;
  auto whole = Drain(**sched.Submit(s));
  ASSERT_EQ(whole.tokens.size(), 10u);
  // The client got 4 tokens and their text; another worker continues from there.
  RequestSpec r = s;
  r.id = "resumed";
  r.resumed.assign(whole.tokens.begin(), whole.tokens.begin() + 4);
  r.prompt.insert(r.prompt.end(), r.resumed.begin(), r.resumed.end());
  const std::string head = eng->get()->tokenizer().Decode(r.resumed);
  r.resumed_text_bytes = static_cast<int64_t>(head.size());
  Outcome rest = Drain(**sched.Submit(r), 4);
  ASSERT_TRUE(rest.final.status.ok());
  std::vector<int32_t> joined(r.resumed);
  joined.insert(joined.end(), rest.tokens.begin(), rest.tokens.end());
  EXPECT_EQ(joined, whole.tokens);
  EXPECT_EQ(head + rest.text, whole.text);
  EXPECT_EQ(rest.final.completion_tokens, 10);
  // A worker that died after the last token but before the end: the resume only ends it,
  // sending the text the client does not have yet.
  RequestSpec done = s;
  done.id = "done";
  done.resumed = whole.tokens;
  done.prompt.insert(done.prompt.end(), whole.tokens.begin(), whole.tokens.end());
  done.resumed_text_bytes = static_cast<int64_t>(head.size());
  Outcome end = Drain(**sched.Submit(done), 10);
  ASSERT_TRUE(end.final.status.ok()) << end.final.status;
  EXPECT_TRUE(end.tokens.empty());
  EXPECT_EQ(end.final.stop_reason, "max_tokens");
  EXPECT_EQ(head + end.text, whole.text);
}

// A stop string that begins inside a token: the text before it has no token of its own and
// goes out with the final message, so every other message carries a token and a reconnect at a
// message's end index never gets text twice.
TEST_F(SchedulerTest, TextAStopReleasesGoesWithTheFinalMessage) {
  engine::EngineOptions eo{.threads = 2};
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok());
  Scheduler sched(**eng, {});
  RequestSpec s = Spec("free", Prompts()[0], 24);
  s.stop_at_eos = false;
  const Outcome whole = Drain(**sched.Submit(s));
  ASSERT_EQ(whole.tokens.size(), 24u);
  // The first token after the third whose text is two or more ASCII characters, the last of them
  // new to the output: a stop string of that character begins inside the token, and the
  // characters before it are released with no token.
  const model::Tokenizer& tok = eng->get()->tokenizer();
  std::string text;
  size_t k = 0, before = 0;
  for (; k < whole.tokens.size(); ++k) {
    const std::string piece = tok.TokenBytes(whole.tokens[k]);
    const bool ascii = std::all_of(piece.begin(), piece.end(), [](char c) { return c > 0; });
    if (!ascii) break;
    if (k >= 3 && piece.size() >= 2 && (text + piece).find(piece.back()) == text.size() + piece.size() - 1) {
      before = text.size() + piece.size() - 1;
      text += piece;
      break;
    }
    text += piece;
  }
  ASSERT_GT(before, 0u) << "no ASCII token of two characters whose last character is new to the output";
  ASSERT_EQ(whole.text.compare(0, text.size(), text), 0) << "the output streams as its tokens' bytes";
  RequestSpec cut = s;
  cut.id = "cut";
  cut.stop_strings = {text.substr(before)};
  auto stream = sched.Submit(cut);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<StreamEvent> events;
  for (bool end = false; !end;) {
    for (StreamEvent& e : (*stream)->Wait(std::chrono::milliseconds(100))) {
      end = e.final;
      events.push_back(std::move(e));
    }
  }
  std::string got;
  for (const StreamEvent& e : events) {
    got += e.text;
    if (!e.final) {
      EXPECT_FALSE(e.tokens.empty()) << "a message with text and no token at index " << e.first_index;
    }
  }
  EXPECT_EQ(got, text.substr(0, before));
  EXPECT_EQ(events.back().stop_reason, "stop_string");
  EXPECT_EQ(events.back().first_index, static_cast<int64_t>(k));
  EXPECT_FALSE(events.back().text.empty()) << "the released text rides on the final message";
}

TEST_F(SchedulerTest, CancelFreesTheSlotAndMemory) {
  engine::EngineOptions eo{.threads = 2, .device_memory_bytes = int64_t{1} << 30};
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok());
  Scheduler sched(**eng, {.max_batch = 1, .max_waiting = 0});
  RequestSpec s = Spec("long", Prompts()[1], 500);
  s.stop_at_eos = false;
  auto stream = sched.Submit(s);
  ASSERT_TRUE(stream.ok());
  // Full: one slot, no queue.
  auto refused = sched.Submit(Spec("second", "hello", 4));
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  // Wait for the first token, then cancel.
  std::vector<StreamEvent> got;
  while (got.empty()) got = (*stream)->Wait(std::chrono::milliseconds(100));
  EXPECT_TRUE(sched.Cancel("long"));
  int64_t seen = 0;
  for (const StreamEvent& e : got) seen += static_cast<int64_t>(e.tokens.size());
  Outcome rest = Drain(**stream, seen);
  EXPECT_TRUE(absl::IsCancelled(rest.final.status)) << rest.final.status;
  // The end of the stream is sent after the state is freed.
  const SchedulerStats st = sched.Stats();
  EXPECT_EQ(st.active, 0);
  EXPECT_EQ(st.reserved_bytes, 0);
  EXPECT_EQ(st.kv_bytes, 0);
  EXPECT_EQ(st.cancelled, 1);
  EXPECT_FALSE(sched.Cancel("long"));
  // The slot is free again.
  Outcome next = Drain(**sched.Submit(Spec("third", "hello", 3)));
  EXPECT_TRUE(next.final.status.ok()) << next.final.status;
}

TEST_F(SchedulerTest, OneTenantCannotHoldMoreThanItsShareOfTheStore) {
  // Sparse mode writes every chunk to the store: a limit of two such requests per tenant.
  engine::EngineOptions eo{.mode = engine::DecodeMode::kSparse, .threads = 2};
  eo.sparse.budget_tokens = 64;
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok()) << eng.status();
  RequestSpec a1 = Spec("a1", Prompts()[0], 200), a2 = Spec("a2", Prompts()[0], 200), a3 = Spec("a3", Prompts()[0], 200);
  RequestSpec b1 = Spec("b1", Prompts()[0], 200), open = Spec("open", Prompts()[0], 200);
  for (RequestSpec* r : {&a1, &a2, &a3}) r->tenant = "team-a";
  b1.tenant = "team-b";
  for (RequestSpec* r : {&a1, &a2, &a3, &b1, &open}) r->stop_at_eos = false;
  const int64_t one = (*eng)->StoreBytes(static_cast<int64_t>(a1.prompt.size()), static_cast<int64_t>(a1.prompt.size()) + 200);
  ASSERT_GT(one, 0);
  // The in-process store charges the blocks written: every layer's, for each complete chunk.
  EXPECT_EQ((*eng)->StoreBytes(100, 100),
            100 / 8 * model_->config.n_layer * model_->config.n_head_kv * 2 * 8 * model_->config.head_dim * 4);
  Scheduler sched(**eng, {.max_batch = 1, .max_waiting = 8, .tenant_max_store_bytes = 2 * one + one / 2});
  auto s1 = sched.Submit(a1), s2 = sched.Submit(a2);
  ASSERT_TRUE(s1.ok() && s2.ok());
  auto refused = sched.Submit(a3);  // a third would pass team-a's share, running and queued together
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("tenant team-a"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("--tenant_max_pool_bytes"), std::string::npos) << refused.status();
  // Another tenant, and requests without one, are not held back by team-a's use.
  auto sb = sched.Submit(b1), so = sched.Submit(open);
  ASSERT_TRUE(sb.ok()) << sb.status();
  ASSERT_TRUE(so.ok()) << so.status();
  // A request that leaves gives its share back: cancelled while queued, then one that ran.
  EXPECT_TRUE(sched.Cancel("a2"));
  EXPECT_TRUE(absl::IsCancelled(Drain(**s2).final.status));
  auto again = sched.Submit(a3);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(sched.Cancel("a1"));
  Drain(**s1);
  RequestSpec a4 = Spec("a4", Prompts()[0], 200);
  a4.tenant = "team-a";
  auto fourth = sched.Submit(a4);
  EXPECT_TRUE(fourth.ok()) << fourth.status();
  for (const char* id : {"a3", "b1", "open", "a4"}) sched.Cancel(id);
  for (auto* st : {&*again, &*sb, &*so, &*fourth}) Drain(**st);
}

// Tenant fairness (two API tenants behind the router): B's requests cannot take every slot, and
// A's prompt is prefilled before B's long ones, so A's answer does not wait for B's prompts.
// Before, A queued behind B (FIFO admission, FIFO prefill) and got its token after B's did.
TEST_F(SchedulerTest, AnotherTenantIsServedWhileOneFloods) {
  auto eng = engine::Engine::Create(*model_, {.mode = engine::DecodeMode::kFull, .threads = 2});
  ASSERT_TRUE(eng.ok()) << eng.status();
  Scheduler sched(**eng, {.max_batch = 4, .max_waiting = 16, .step_tokens = 256});  // B may hold 3 slots
  std::vector<std::shared_ptr<RequestStream>> b = FloodOfB(sched, 6, Prompts()[3] + " " + Prompts()[3]);
  ASSERT_EQ(b.size(), 6u);
  ASSERT_GE(WaitForActive(sched, 3), 3);  // A comes once B holds its slots
  RequestSpec a = Spec("a", Prompts()[0], 1);
  a.tenant = "team-a";
  a.tenants = 2;
  auto sa = sched.Submit(a);
  ASSERT_TRUE(sa.ok()) << sa.status();
  const Outcome got = Drain(**sa);
  ASSERT_TRUE(got.final.status.ok()) << got.final.status;
  EXPECT_EQ(got.tokens.size(), 1u);
  // When A is done, at most the first of B's prompts (already being read when A came) has
  // produced a token, and B's fourth to sixth requests have not started at all.
  int b_started = 0;
  std::vector<std::vector<StreamEvent>> seen;
  for (auto& s : b) {
    seen.push_back(s->Wait(std::chrono::milliseconds(0)));
    b_started += seen.back().empty() ? 0 : 1;
  }
  EXPECT_LE(b_started, 1) << "B's prompts were read before A's";
  for (int i = 0; i < 6; ++i) sched.Cancel("b" + std::to_string(i));
  for (int i = 3; i < 6; ++i) EXPECT_TRUE(seen[i].empty()) << "b" << i << " took a fourth slot";
  for (int i = 0; i < 6; ++i) {  // to their end, counting the tokens already taken
    int64_t taken = 0;
    bool ended = false;
    for (const StreamEvent& e : seen[i]) taken += static_cast<int64_t>(e.tokens.size()), ended |= e.final;
    if (!ended) Drain(*b[i], taken);
  }
}

// Device memory between tenants: B cannot fill the device's KV room with its requests, so A's
// request is admitted at once instead of waiting for B's to finish (slots are not the limit).
TEST_F(SchedulerTest, OneTenantCannotFillTheDeviceMemory) {
  const engine::MemoryPlan plan(*model_, engine::DecodeMode::kFull, {}, 512);
  const std::string long_prompt = Prompts()[3];
  const int64_t n = static_cast<int64_t>(Encode(long_prompt).size());
  const engine::RequestBytes one = plan.Request(n, n + 200);
  // Room for four of B's requests, even all prefilling at once; B may hold three and a half.
  engine::EngineOptions eo{.threads = 2, .device_memory_bytes = plan.weight_bytes() + plan.shared_workspace_bytes() +
                                                                4 * (one.steady() + one.prefill_extra)};
  for (const bool limited : {true, false}) {
    auto eng = engine::Engine::Create(*model_, eo);
    ASSERT_TRUE(eng.ok()) << eng.status();
    Scheduler sched(**eng, {.max_batch = 8, .max_waiting = 16,
                            .tenant_max_device_bytes = limited ? 3 * one.steady() + one.steady() / 2 : 0});
    std::vector<std::shared_ptr<RequestStream>> b = FloodOfB(sched, 5, long_prompt);
    ASSERT_EQ(b.size(), 5u);
    const int want = limited ? 3 : 4;  // the device's room, or B's share of it
    ASSERT_EQ(WaitForActive(sched, want), want);
    RequestSpec a = Spec("a", Prompts()[0], 1);
    a.tenant = "team-a";
    a.tenants = 2;
    auto sa = sched.Submit(a);
    ASSERT_TRUE(sa.ok()) << sa.status();
    if (limited) {
      EXPECT_TRUE(Drain(**sa).final.status.ok());
      EXPECT_TRUE(b[3]->Wait(std::chrono::milliseconds(0)).empty()) << "B took a fourth request's memory";
    }  // else B holds the whole device: A waits until one of B's 200-token requests ends
    sched.Cancel("a");
    for (int i = 0; i < 5; ++i) sched.Cancel("b" + std::to_string(i));
    if (!limited) b.push_back(*sa);
    for (auto& s : b) {  // to their ends
      bool ended = false;
      while (!ended) {
        for (const StreamEvent& e : s->Wait(std::chrono::milliseconds(100))) ended |= e.final;
      }
    }
  }
}

TEST_F(SchedulerTest, BadRequestsNameTheProblem) {
  // A budget that holds a 4K-token request but not a 30K-token one.
  const engine::MemoryPlan plan(*model_, engine::DecodeMode::kFull, {}, 512);
  const engine::RequestBytes small = plan.Request(8, 4096);
  engine::EngineOptions eo{.threads = 2, .device_memory_bytes = plan.weight_bytes() + plan.shared_workspace_bytes() +
                                                                small.steady() + small.prefill_extra};
  auto eng = engine::Engine::Create(*model_, eo);
  ASSERT_TRUE(eng.ok()) << eng.status();
  Scheduler sched(**eng, {});
  RequestSpec empty = Spec("a", "x", 4);
  empty.prompt.clear();
  EXPECT_TRUE(absl::IsInvalidArgument(sched.Submit(empty).status()));
  RequestSpec zero = Spec("b", "x", 0);
  auto z = sched.Submit(zero);
  EXPECT_TRUE(absl::IsInvalidArgument(z.status()));
  EXPECT_NE(z.status().message().find("max_new_tokens"), std::string::npos) << z.status();
  RequestSpec hot = Spec("c", "x", 4);
  hot.sampling.temperature = -1;
  auto h = sched.Submit(hot);
  EXPECT_NE(h.status().message().find("temperature"), std::string::npos) << h.status();
  RequestSpec huge = Spec("d", "x", 30000);  // fits the context, not the 600 MiB budget
  auto g = sched.Submit(huge);
  EXPECT_TRUE(absl::IsResourceExhausted(g.status())) << g.status();
}

// Security model (docs/decisions/0026-security-model.md): Worker.Submit reached without the router refuses what the router
// refuses (e.g. max_new_tokens 10^12), with the field named.
TEST_F(SchedulerTest, WorkerServiceValidatesLikeTheRouter) {
  auto eng = engine::Engine::Create(*model_, {.threads = 2});
  ASSERT_TRUE(eng.ok()) << eng.status();
  Scheduler sched(**eng, {.max_new_tokens_limit = 100});
  WorkerService service(sched, {.worker_id = "w", .model = model_->config.name});
  dd::worker::v1::SubmitRequest sub;
  dd::v1::GenerateRequest& req = *sub.mutable_request();
  req.set_request_id("r1");
  req.set_text("hello");
  req.set_max_new_tokens(100);
  ASSERT_TRUE(service.ToSpec(sub).ok());
  for (int64_t bad : {int64_t{1000000000000}, int64_t{101}, int64_t{0}}) {
    req.set_max_new_tokens(bad);
    auto r = service.ToSpec(sub);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << bad;
    EXPECT_NE(r.status().message().find("max_new_tokens"), std::string::npos) << r.status();
  }
  req.set_max_new_tokens(8);
  for (int i = 0; i < 17; ++i) req.add_stop("x");
  auto many = service.ToSpec(sub);
  EXPECT_NE(many.status().message().find("stop: 17 strings"), std::string::npos) << many.status();
}

}  // namespace
}  // namespace dd::worker
