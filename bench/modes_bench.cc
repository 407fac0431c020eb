// Decode-modes benchmark (docs/decisions/0006-decode-modes.md, docs/decisions/0012-resident-set.md;
// results in docs/benchmarks.md, "Decode modes"): full, sparse, sparse-cached (chunks
// resident across steps, misses fetched: the paper's ShadowKV-style baseline) and dualdecoder
// on the resident set, side by side in one run, per context, batch and link. Writes one JSON object.
//
// Each (mode, context) prefills one sequence once, decodes it one step (so it holds its
// steady decode state) and forks it into the batch's slots, so a figure is the decode cost at
// that context. Every engine runs under one device-memory budget (--device_memory); each
// mode's maximum batch comes from its MemoryPlan (room left for one more request's prefill)
// and is run too, with every slot admitted by the engine. The `pcie5` link is calibrated in this
// run so that one sparse layer's miss traffic under sparse-cached (one request, measured on the
// infinite link) takes as long as one layer of a sparse-cached step's compute at batch 1 (the
// paper's "transfer time comparable to compute" regime, docs/decisions/0016-link-model.md);
// `inmem` is an infinitely fast link.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/status_macros.h"
#include "dd/backend/registry.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/service/engine_flags.h"
#include "kv-pool/client/transfer_queue.h"
#include "kv-pool/server/pool_process.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"4096"}), "Context lengths");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "4"}),
          "Batch sizes; 'max' = the mode's largest batch under --device_memory");
ABSL_FLAG(int32_t, steps, 12, "Timed decode steps per run");
ABSL_FLAG(int32_t, rounds, 1,
          "Turns the modes of one store take at each link and batch: every mode runs steps/rounds timed "
          "steps, then the next mode, and again (a slow spell of a shared machine falls on every mode alike; "
          "but dualdecoder's steps measured slower interleaved than in one turn, cause not found: "
          "docs/decisions/0032-benchmark-methodology.md). 1 = each mode's steps in one turn");
ABSL_FLAG(int32_t, decode_threads, -1,
          "Compute threads of the timed decode steps, every mode and link alike (0 = all of --threads; "
          "-1 = all but one, at least 1: the transfer thread or pool process gets a core of its own, as a "
          "GPU's copy engines do not take its compute; docs/decisions/0032-benchmark-methodology.md)");
ABSL_FLAG(int64_t, max_batch_cap, 64, "Upper bound for 'max' batches (CPU time)");
ABSL_FLAG(std::string, text_file, "/usr/share/common-licenses/GPL-3", "Natural text for prompts");
ABSL_FLAG(std::string, out, "", "Output JSON path");
ABSL_FLAG(std::vector<std::string>, stores, std::vector<std::string>({"inproc"}),
          "Where sparse modes keep offloaded KV: inproc (with the inmem and pcie5 link models), shm, ucx-tcp, "
          "ucx-sm (a real dd-kv-pool started by the benchmark; the transport itself is the link)");
ABSL_FLAG(bool, spin_yield, true,
          "Spinning UCX threads yield their core every 16 idle polls: the pool's --ucx_spin_yield and the "
          "engine's $DD_UCX_SPIN_YIELD (false: neither, for comparison)");
ABSL_FLAG(int64_t, pool_spin_us, -1, "The pool's --ucx_spin_us (-1: the pool's default)");
ABSL_FLAG(std::vector<std::string>, pool_lanes, std::vector<std::string>({"1"}),
          "Transfer lanes of the pool stores' runs, one run set per count (the link is labelled e.g. ucx-tcp-x2; "
          "0 = gathers on the compute thread, labelled ucx-tcp-inline)");
ABSL_FLAG(std::vector<std::string>, spec_heads, std::vector<std::string>({"context"}),
          "dualdecoder runs, one per speculative head (context, full, auto: the model's default; full is labelled "
          "dualdecoder-fullhead; a head already listed is run once); "
          "pool stores run the first only");

ABSL_FLAG(std::vector<std::string>, modes, {},
          "Only these mode labels (e.g. dualdecoder,sparse; default: all). Without sparse-cached the pcie5 "
          "link is not calibrated and not run");
ABSL_FLAG(std::vector<std::string>, candidate_runs, {},
          "dualdecoder: further in-process runs of the first head, one per speculative-candidate count (x the "
          "budget, 0 = every chunk), labelled dualdecoder-candN; --spec_candidates sets every other dualdecoder run's");
ABSL_FLAG(std::vector<std::string>, reconstruction_runs, {},
          "dualdecoder: further runs of the first head on every store, one per key reconstruction "
          "(docs/decisions/0052-low-rank-key-reconstruction.md): auto, all, or layers:L+L+... (an offline list), "
          "labelled dualdecoder-keys-auto, -keys-all, -keys-L+L");
ABSL_FLAG(bool, carry_ab, false,
          "dualdecoder: also run the first head on the in-process store without the carry (EngineOptions::spec_carry), "
          "labelled as it with -nocarry (models whose first layer is sparse have nothing to carry: not run)");
ABSL_FLAG(std::vector<std::string>, selection_models, {},
          "Synthetic weights: the sparse modes' chunks follow each stated model in turn, "
          "OVERLAP:HIT[:RESIDENT_WASTE[:SEED]] (decode-worker/engine/selection_model.h; e.g. 0.7:0.95:0.4,0.7:0.7:0.4; "
          "1:1 moves nothing after the first step: the infinite link); every run records its model. Default: the "
          "landmark scores' own selection");
ABSL_FLAG(bool, synthetic_kv, false,
          "Slot 0's context is random KV (Engine::PrefillSynthetic) instead of a computed prefill: for long "
          "contexts of synthetic models; only the last prompt token is prefilled");
ABSL_FLAG(bool, pcie5_link, true,
          "Also run the sparse modes of the in-process store on the pcie5 link model (calibrated in the run). "
          "false: inmem only (on a GPU the in-process store's transfers are real PCIe copies already)");
ABSL_FLAG(std::string, pool_memory, "16GiB", "Memory of the dd-kv-pool the pool stores start");
namespace {
using Clock = std::chrono::steady_clock;
using dd::engine::DecodeMode;
using dd::engine::Engine;

using Totals = dd::engine::KvLayerStats;
Totals Sum(const Engine& e) { return e.kv().total_stats(); }

struct RunSpec {
  std::string label;  // the mode's name, or a variant's (dualdecoder-fullhead, -cand N, -nocarry)
  DecodeMode mode;
  int64_t ctx, batch, budget_tokens, max_batch;
  std::string link;
  double link_gbps;
  bool at_max = false;  // the batch is the mode's largest ('max', within --max_batch_cap)
  std::string selection = "off";  // the selection model (SelectionModel::ToString)
};

// One (mode, link, batch) measurement. Begin forks and warms up; Round runs some timed steps
// (the modes of a store take turns round by round); Finish reads the counters and releases
// the forks. Returns of Begin/Round: a failed fork or step.
struct Measurement {
  RunSpec spec;
  Engine* e = nullptr;
  std::unique_ptr<dd::bench::DecodeRun> run;
  Totals before;
  int64_t wait0 = 0, base_bytes = 0, carried0 = 0;
  std::vector<double> round_tps;

  size_t first_step = 0;  // this report's first step in run->step_ms()

  absl::Status Begin(int32_t t0) {
    base_bytes = e->kv_bytes();
    run = std::make_unique<dd::bench::DecodeRun>(*e, spec.batch, t0);
    RETURN_IF_ERROR(run->Start());
    return Restart(/*warm_step=*/false);
  }

  // The next report's counters and steps start here; after a change of selection model, one
  // untimed step under it first.
  absl::Status Restart(bool warm_step) {
    if (warm_step) RETURN_IF_ERROR(run->Steps(1));
    first_step = run->step_ms().size();
    round_tps.clear();
    before = Sum(*e);
    wait0 = e->transfer_wait_ns();
    carried0 = e->carried_rows();
    return absl::OkStatus();
  }

  absl::Status Round(int steps) {
    const size_t first = run->step_ms().size();
    RETURN_IF_ERROR(run->Steps(steps));
    double ms = 0;
    for (size_t i = first; i < run->step_ms().size(); ++i) ms += run->step_ms()[i];
    round_tps.push_back(spec.batch * steps / (ms / 1000));
    return absl::OkStatus();
  }

  // The steps since Begin or Restart; the forks stay (Release drops them).
  nlohmann::json Report() {
    const Totals after = Sum(*e);
    const double dev_per_req = static_cast<double>(e->kv_bytes() - base_bytes) / spec.batch;
    std::vector<double> step_ms(run->step_ms().begin() + static_cast<std::ptrdiff_t>(first_step), run->step_ms().end());
    const int steps = static_cast<int>(step_ms.size());
    double total_ms = 0;
    for (double x : step_ms) total_ms += x;
    const std::vector<double> in_order = step_ms;
    std::sort(step_ms.begin(), step_ms.end());
    const int64_t bb = e->kv().block_bytes();
    // Blocks whose V half alone moved count half (keys rebuilt on the device).
    const int64_t prefetch_bytes =
        dd::engine::MovedBytes(after.prefetched - before.prefetched, after.prefetched_values - before.prefetched_values, bb);
    const int64_t urgent_bytes =
        dd::engine::MovedBytes(after.urgent - before.urgent, after.urgent_values - before.urgent_values, bb);
    const RunSpec& r = spec;
    return nlohmann::json{
        {"mode", r.label}, {"context", r.ctx}, {"batch", r.batch},
        {"link", r.link}, {"link_gbps", r.link_gbps}, {"budget_tokens", r.budget_tokens},
        {"tokens_per_s", r.batch * steps / (total_ms / 1000)}, {"step_ms_p50", step_ms[step_ms.size() / 2]},
        {"round_tokens_per_s", round_tps},
        {"step_ms", in_order},  // every timed step, in order
        {"hit_rate", after.predicted_for > before.predicted_for
                         ? double(after.hits - before.hits) / (after.predicted_for - before.predicted_for) : 0.0},
        {"prefetch_bytes", prefetch_bytes},
        {"urgent_bytes", urgent_bytes},
        {"wasted_bytes", dd::engine::MovedBytes(after.wasted - before.wasted, after.wasted_values - before.wasted_values, bb)},
        // Key reconstruction: chunks whose keys were rebuilt, and the layers' steps doing it.
        {"reconstructed_chunks", after.reconstructed - before.reconstructed},
        {"rebuilt_chunks", after.rebuilt - before.rebuilt},
        {"reconstructing_layer_steps", after.reconstructing_steps - before.reconstructing_steps},
        {"reused_chunks", after.reused - before.reused},
        {"selected_chunks", after.selected - before.selected},
        {"evictions", after.evictions - before.evictions},
        // Bytes per step: on the critical path (urgent) and in the background (prefetch).
        {"urgent_bytes_per_step", static_cast<double>(urgent_bytes) / steps},
        {"prefetch_bytes_per_step", static_cast<double>(prefetch_bytes) / steps},
        {"wait_ms_per_step", (e->transfer_wait_ns() - wait0) / 1e6 / steps},
        // Real rows that started from their speculative row's carried state, per decoded token.
        {"carried_fraction", double(e->carried_rows() - carried0) / (r.batch * steps)},
        {"device_bytes_per_request", dev_per_req},
        {"max_batch_in_budget", r.max_batch}, {"at_max_batch", r.at_max}, {"selection_model", r.selection}};
  }
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto loaded = dd::worker::LoadModelFromFlags();
  if (!loaded.ok()) {
    std::cerr << "modes_bench: " << loaded.status().message() << "\n";
    return 1;
  }
  const auto& model = **loaded;
  auto prompts = dd::bench::TextPrompts::Load(model, absl::GetFlag(FLAGS_text_file));
  // The engine's flags, resolved as ddctl and dd-decode-worker resolve them (the same defaults);
  // each run then sets its mode, speculative head and store.
  absl::StatusOr<dd::engine::EngineOptions> base = dd::worker::EngineOptionsFromFlags();
  if (base.ok() && base->mode != DecodeMode::kFull) {
    base = absl::InvalidArgumentError("--mode: this benchmark runs every mode (choose them with --modes)");
  } else if (base.ok() && base->spec_head != dd::engine::SpecHead::kAuto) {
    base = absl::InvalidArgumentError("--spec_head: this benchmark runs the heads of --spec_heads");
  } else if (base.ok() && base->kv_store != "inproc://") {
    base = absl::InvalidArgumentError("--kv_store: this benchmark starts its own pool (choose stores with --stores)");
  } else if (base.ok() && base->prefix_block_tokens != 0) {
    base = absl::InvalidArgumentError("--prefix_block: this benchmark runs without prefix reuse");
  }
  if (!prompts.ok() || !base.ok()) {
    std::cerr << "modes_bench: " << (prompts.ok() ? base.status() : prompts.status()).message() << "\n";
    return 1;
  }
  const int64_t device_memory = base->device_memory_bytes;
  const int64_t V = model.config.n_vocab, budget = base->sparse.budget_tokens;
  const std::string device = base->device;
  std::fprintf(stderr, "modes_bench: device %s (%s)\n", device.c_str(), base->device_why.c_str());
  // The weights on the device (MemoryPlan's) and those a decode step reads (all but an untied
  // embedding table, of which it reads a row per token), for roofline figures.
  int64_t weight_bytes = 0, step_weight_bytes = 0;
  const dd::kernels::WeightView& embd = model.weights.token_embd;
  const int64_t embd_bytes = model.config.tied_embeddings ? 0 : embd.row_bytes * embd.rows;
  const int steps = absl::GetFlag(FLAGS_steps), rounds = absl::GetFlag(FLAGS_rounds);
  nlohmann::json runs = nlohmann::json::array(), max_batches = nlohmann::json::array();
  double pcie_gbps = 0;
  auto fail = [](const absl::Status& st) {
    std::cerr << "modes_bench: " << st.message() << "\n";
    return 1;
  };
  auto skipped = [](const RunSpec& r, const absl::Status& st) {
    std::fprintf(stderr, "%-11s ctx %6lld batch %2lld link %-5s: skipped: %s\n", r.label.c_str(),
                 static_cast<long long>(r.ctx), static_cast<long long>(r.batch), r.link.c_str(),
                 std::string(st.message()).c_str());
  };
  if (steps < 1 || rounds < 1 || rounds > steps) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--steps ", steps, " --rounds ", rounds, ": need 1 <= rounds <= steps")));
  }
  std::unique_ptr<dd::kvpool::testing_util::PoolProcess> pool;  // started for the first pool store
  const int threads = base->threads > 0 ? base->threads
                                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int decode_threads = absl::GetFlag(FLAGS_decode_threads);
  if (decode_threads < -1 || decode_threads > threads) {
    return fail(absl::InvalidArgumentError(absl::StrCat("--decode_threads ", decode_threads, ": must be -1, 0 or 1..",
                                                        threads, " (the engine's threads)")));
  }
  if (decode_threads == 0) decode_threads = threads;
  if (decode_threads == -1) decode_threads = std::max(1, threads - 1);
  std::fprintf(stderr, "modes_bench: %d compute threads for prefill, %d for the timed decode steps\n", threads,
               decode_threads);
  std::vector<int> lane_counts;
  for (int64_t n : dd::bench::Ints(absl::GetFlag(FLAGS_pool_lanes), "--pool_lanes", 0,
                                   dd::kvpool::TransferQueue::kMaxLanes)) {
    lane_counts.push_back(static_cast<int>(n));
  }
  // The speculative shortlist of the dualdecoder runs (--spec_candidates), then one extra run per
  // --candidate_runs count.
  std::vector<int64_t> candidate_counts = {base->sparse.spec_candidates};
  if (const std::vector<std::string> runs = absl::GetFlag(FLAGS_candidate_runs); !runs.empty()) {
    for (int64_t n : dd::bench::Ints(runs, "--candidate_runs", 0, dd::engine::SparseOptions::kMaxSpecCandidates)) {
      candidate_counts.push_back(n);
    }
  }
  // --reconstruction_runs: a label suffix and the key reconstruction of each.
  std::vector<std::pair<std::string, dd::engine::KeyReconstructionOptions>> reconstructions;
  for (const std::string& r : absl::GetFlag(FLAGS_reconstruction_runs)) {
    dd::engine::KeyReconstructionOptions kr;
    absl::Status spec = dd::engine::ApplyKeyReconstructionSpec(r, &kr);
    if (spec.ok() && !kr.enabled()) spec = absl::InvalidArgumentError("off is every run's reference, not a run of its own");
    if (!spec.ok()) return fail(absl::InvalidArgumentError(absl::StrCat("--reconstruction_runs: ", spec.message())));
    kr.rank = base->sparse.key_reconstruction.rank;
    reconstructions.emplace_back(absl::StrCat("-keys-", r.substr(absl::StartsWith(r, "layers:") ? 7 : 0)), kr);
  }
  // Requested batches, parsed once; 0 stands for 'max' (each mode's largest).
  std::vector<int64_t> batch_req;
  for (const std::string& b : absl::GetFlag(FLAGS_batches)) {
    int64_t n = 0;
    if (b != "max" && (!absl::SimpleAtoi(b, &n) || n < 1)) {
      return fail(absl::InvalidArgumentError(absl::StrCat("--batches '", b, "': expected a positive integer or max")));
    }
    batch_req.push_back(n);
  }
  const bool asks_max = std::find(batch_req.begin(), batch_req.end(), 0) != batch_req.end();
  if (asks_max && device_memory <= 0) {
    return fail(absl::InvalidArgumentError("--batches max needs --device_memory (the budget the largest batch fills)"));
  }
  std::vector<dd::engine::SelectionModel> selections;
  for (const std::string& spec : absl::GetFlag(FLAGS_selection_models)) {
    auto m = dd::engine::SelectionModel::Parse(spec);
    if (!m.ok()) return fail(absl::InvalidArgumentError(absl::StrCat("--selection_models: ", m.status().message())));
    selections.push_back(*m);
  }
  if (selections.empty()) selections.push_back({});  // off: the landmark scores select
  const bool synthetic_kv = absl::GetFlag(FLAGS_synthetic_kv);
  const std::vector<std::string> stores = absl::GetFlag(FLAGS_stores);
  const std::vector<int64_t> contexts = dd::bench::Ints(absl::GetFlag(FLAGS_contexts), "--contexts", 1);
  // Checked before any run: sparse-cached with a budget covering the context misses only the
  // newest chunk, so the calibrated link came out ~0 GB/s (a step of sparse on it took 33 s).
  const bool models_link = absl::GetFlag(FLAGS_pcie5_link) && std::find(stores.begin(), stores.end(), "inproc") != stores.end();
  for (int64_t ctx : contexts) {
    if (models_link && budget >= ctx) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--budget ", budget, " covers context ", ctx, ": the pcie5 link is calibrated on ",
                       "sparse-cached's misses, which a budget below the context has; use a smaller --budget ",
                       "or --stores without inproc")));
    }
  }
  for (int64_t ctx : contexts) {
    const std::vector<int32_t> prompt = prompts->Of(ctx);
    const int64_t total = ctx + 8 * (steps + 2);  // room for every run's decode steps
    struct Variant {
      std::string label;
      DecodeMode mode;
      dd::engine::SpecHead head;
      std::string store;  // inproc, shm, ucx-tcp, ucx-sm
      int lanes = 1;           // a pool store's transfer lanes
      int64_t spec_candidates = dd::engine::SparseOptions::kAutoSpecCandidates;
      bool carry = true;
      dd::engine::KeyReconstructionOptions keys{};
    };
    std::vector<Variant> variants = {{"full", DecodeMode::kFull, dd::engine::SpecHead::kContext, "inproc"}};
    for (const std::string& store : stores) {
      if (store != "inproc" && store != "shm" && store != "ucx-tcp" && store != "ucx-sm") {
        return fail(absl::InvalidArgumentError(absl::StrCat("--stores: unknown store '", store,
                                                            "' (inproc, shm, ucx-tcp, ucx-sm)")));
      }
      for (int lanes : store == "inproc" ? std::vector<int>{1} : lane_counts) {
        // sparse-cached first: its infinite-link run calibrates the pcie5 link.
        variants.push_back({"sparse-cached", DecodeMode::kSparseCached, dd::engine::SpecHead::kContext, store, lanes});
        variants.push_back({"sparse", DecodeMode::kSparse, dd::engine::SpecHead::kContext, store, lanes});
        // Every head on the in-process store; a pool store runs the first head only (CPU time).
        for (const std::string& h : absl::GetFlag(FLAGS_spec_heads)) {
          auto parsed = dd::engine::ParseSpecHead(h);
          if (!parsed.ok()) return fail(parsed.status());
          const dd::engine::SpecHead head = dd::engine::ResolveSpecHead(*parsed, model.config);  // auto: per model
          if (std::any_of(variants.begin(), variants.end(), [&](const Variant& v) {
                return v.mode == DecodeMode::kDualDecoder && v.store == store && v.lanes == lanes &&
                       v.head == head;
              })) {
            continue;  // e.g. auto,context,full: auto already ran one of the two
          }
          variants.push_back({head == dd::engine::SpecHead::kFull ? "dualdecoder-fullhead" : "dualdecoder",
                              DecodeMode::kDualDecoder, head, store, lanes, candidate_counts.front()});
          // Key reconstruction runs of the first head, on every store.
          const Variant first = variants.back();
          for (const auto& [suffix, kr] : reconstructions) {
            Variant v = first;
            v.label = first.label + suffix;
            v.keys = kr;
            variants.push_back(v);
          }
          if (store != "inproc" || !reconstructions.empty()) break;
        }
      }
      if (store == "inproc" && variants.back().mode == DecodeMode::kDualDecoder) {
        // Further speculative-candidate counts, with the first head.
        const Variant first = *std::find_if(variants.begin(), variants.end(), [](const Variant& v) {
          return v.mode == DecodeMode::kDualDecoder && v.store == "inproc";
        });
        for (size_t i = 1; i < candidate_counts.size(); ++i) {
          Variant v = first;
          v.label = absl::StrCat("dualdecoder-cand", candidate_counts[i]);
          v.spec_candidates = candidate_counts[i];
          variants.push_back(v);
        }
        // Only where there is something to carry: exact (sliding) layers before the first sparse
        // one (this bench sets neither --sparse_layers nor prefix reuse, which would change that).
        if (absl::GetFlag(FLAGS_carry_ab) && model.config.layer_is_swa[0]) {
          Variant v = first;
          v.label = first.label + "-nocarry";
          v.carry = false;
          variants.push_back(v);
        }
      }
    }
    if (const std::vector<std::string> only = absl::GetFlag(FLAGS_modes); !only.empty()) {
      for (const std::string& m : only) {
        if (std::none_of(variants.begin(), variants.end(), [&](const Variant& v) { return v.label == m; })) {
          return fail(absl::InvalidArgumentError(absl::StrCat("--modes: no mode '", m, "' in this run")));
        }
      }
      std::erase_if(variants, [&](const Variant& v) { return std::find(only.begin(), only.end(), v.label) == only.end(); });
    }
    const bool calibrates = absl::GetFlag(FLAGS_pcie5_link) &&
                            std::any_of(variants.begin(), variants.end(), [](const Variant& v) {
                              return v.mode == DecodeMode::kSparseCached && v.store == "inproc";
                            });
    // With turns (--rounds > 1) a store's modes (and a pool store's lane count) form a group:
    // every engine of the group is built and prefilled first, then each (link, batch) is
    // measured for all of them in turns, so a slow spell of this shared machine falls on every
    // mode alike. With one turn each mode is its own group: one engine alive at a time, its
    // links and batches in a row (the earlier results' order and memory).
    for (size_t g0 = 0; g0 < variants.size();) {
      size_t g1 = g0 + 1;
      while (rounds > 1 && g1 < variants.size() && variants[g1].store == variants[g0].store &&
             variants[g1].lanes == variants[g0].lanes) {
        ++g1;
      }
      struct Entry {
        const Variant* v;
        std::unique_ptr<Engine> engine;
        int32_t t0 = 0;
        int64_t max_batch = 0;
        std::vector<std::string> links;
      };
      std::vector<Entry> group;
      for (size_t vi = g0; vi < g1; ++vi) {
        const Variant& variant = variants[vi];
        const DecodeMode mode = variant.mode;
        const std::string& label = variant.label;
        dd::engine::EngineOptions o = *base;
        o.mode = mode;
        o.spec_head = variant.head;
        o.sparse.spec_candidates = variant.spec_candidates;
        o.spec_carry = variant.carry && base->spec_carry;
        if (variant.keys.enabled()) o.sparse.key_reconstruction = variant.keys;
        o.threads = threads;
        if (variant.store != "inproc") {
          if (!pool) {
            std::vector<std::string> flags{
                "--ucx_tcp",  // ucx-tcp runs: a loopback benchmark (only on a network where every peer is trusted)
                dd::kvpool::testing_util::SpinYieldEverywhere(absl::GetFlag(FLAGS_spin_yield))};
            if (const int64_t spin = absl::GetFlag(FLAGS_pool_spin_us); spin >= 0) {
              flags.push_back(absl::StrCat("--ucx_spin_us=", spin));
            }
            pool = std::make_unique<dd::kvpool::testing_util::PoolProcess>(60000, absl::GetFlag(FLAGS_pool_memory),
                                                                           std::move(flags));
          }
          if (pool->address().empty()) return fail(absl::UnavailableError("dd-kv-pool did not start"));
          // UCX reads UCX_TLS when the engine's pool client creates its context.
          if (variant.store == "ucx-tcp") setenv("UCX_TLS", "tcp", 1);
          if (variant.store == "ucx-sm") setenv("UCX_TLS", "sm,self", 1);
          setenv("DD_KV_TRANSFER_LANES", absl::StrCat(variant.lanes).c_str(), 1);
          o.kv_store = (variant.store == "shm" ? "shm://" : "ucx://") + pool->address();
          o.kv_store_token = dd::kvpool::testing_util::kAlice;
        }
        auto engine = Engine::Create(model, o);
        if (!engine.ok()) return fail(engine.status());
        Entry entry;
        entry.v = &variant;
        entry.engine = std::move(*engine);
        Engine& e = *entry.engine;
        entry.max_batch = e.memory_plan().MaxBatch(device_memory, ctx, total);
        weight_bytes = e.memory_plan().weight_bytes();
        step_weight_bytes = weight_bytes - embd_bytes;
        max_batches.push_back({{"mode", label}, {"context", ctx},
                               {"max_batch", entry.max_batch},
                               {"kv_bytes_per_request", e.memory_plan().Request(ctx, total).kv}});
        std::fprintf(stderr, "%-11s ctx %6lld: max batch %lld in %s (%s per request); prefilling\n",
                     label.c_str(), static_cast<long long>(ctx), static_cast<long long>(entry.max_batch),
                     dd::engine::MiB(device_memory).c_str(),
                     dd::engine::MiB(e.memory_plan().Request(ctx, total).steady()).c_str());
        // Slot 0 is the prompt's source; it counts against the budget like one request.
        if (absl::Status st = e.Admit(0, ctx, total); !st.ok()) return fail(st);
        absl::StatusOr<std::vector<float>> first;
        if (synthetic_kv) {  // random KV for all but the last prompt token, which is prefilled
          std::vector<std::vector<float>> last;
          const Engine::PrefillPiece piece{0, prompt, ctx - 1, ctx};
          absl::Status st = e.PrefillSynthetic(0, prompt, ctx - 1, /*seed=*/ctx);
          if (st.ok()) st = e.PrefillParts(absl::MakeConstSpan(&piece, 1), &last);
          if (st.ok()) first = std::move(last[0]);
          else first = st;
        } else {
          first = e.Prefill(0, prompt);
        }
        if (!first.ok()) return fail(first.status());
        int32_t seq0 = 0, t0 = dd::engine::Argmax(first->data(), V);
        std::vector<float> step_logits;
        if (absl::Status st = e.DecodeStep(absl::MakeConstSpan(&seq0, 1), absl::MakeConstSpan(&t0, 1), &step_logits);
            !st.ok()) {
          return fail(st);
        }
        entry.t0 = dd::engine::Argmax(step_logits.data(), V);
        e.SetComputeThreads(decode_threads);
        // inproc: the link models; a pool store: the real transport, labelled by its name.
        entry.links = {variant.store == "inproc" ? "inmem"
                       : variant.lanes == 1      ? variant.store
                       : variant.lanes == 0      ? absl::StrCat(variant.store, "-inline")
                                                 : absl::StrCat(variant.store, "-x", variant.lanes)};
        if (mode != DecodeMode::kFull && variant.store == "inproc" && calibrates) entry.links.push_back("pcie5");
        group.push_back(std::move(entry));
      }
      g0 = g1;
      std::vector<std::string> links;  // in order of first appearance (inmem calibrates pcie5)
      for (const Entry& en : group) {
        for (const std::string& l : en.links) {
          if (std::find(links.begin(), links.end(), l) == links.end()) links.push_back(l);
        }
      }
      for (const std::string& link : links) {
        for (Entry& en : group) {
          if (std::find(en.links.begin(), en.links.end(), link) == en.links.end()) continue;
          dd::kvpool::LinkModel lm;
          if (link == "pcie5") lm = {.bandwidth_gbps = pcie_gbps, .latency_us = 10};
          en.engine->SetLink(lm);
        }
        // Per batch: every entry forks once, then runs each selection model in turn (a 128K
        // fork copies tens of GB: not once per model).
        std::vector<std::vector<int64_t>> done(group.size());  // batches run per entry (no repeats)
        for (int64_t req : batch_req) {
          std::vector<Measurement> ms;
          for (size_t k = 0; k < group.size(); ++k) {
            Entry& en = group[k];
            if (std::find(en.links.begin(), en.links.end(), link) == en.links.end()) continue;
            // Slot 0 holds one request's worth, so the largest batch of forks is max - 1.
            const int64_t largest = std::min(en.max_batch - 1, absl::GetFlag(FLAGS_max_batch_cap));
            const int64_t n = req == 0 ? largest : req;
            if (n < 1 || std::find(done[k].begin(), done[k].end(), n) != done[k].end()) continue;
            done[k].push_back(n);
            en.engine->SetSelectionModel(selections.front());
            Measurement m;
            m.spec = RunSpec{en.v->label, en.v->mode, ctx, n, budget, en.max_batch, link,
                             link == "pcie5" ? pcie_gbps : 0.0, asks_max && n == largest};
            m.e = en.engine.get();
            ms.push_back(std::move(m));
            if (absl::Status st = ms.back().Begin(en.t0); !st.ok()) {
              skipped(ms.back().spec, st);
              ms.pop_back();
            }
          }
          for (size_t si = 0; si < selections.size(); ++si) {
            const dd::engine::SelectionModel& selection = selections[si];
            std::vector<Measurement*> now;  // full selects nothing: its run once, under the first
            for (Measurement& m : ms) {
              if (m.spec.mode == DecodeMode::kFull && si > 0) continue;
              m.spec.selection = m.spec.mode == DecodeMode::kFull ? "off" : selection.ToString();
              if (si > 0) {
                m.e->SetSelectionModel(selection);
                if (absl::Status st = m.Restart(/*warm_step=*/true); !st.ok()) {
                  skipped(m.spec, st);
                  continue;
                }
              }
              now.push_back(&m);
            }
            for (int round = 0; round < rounds; ++round) {
              const int n = steps / rounds + (round < steps % rounds ? 1 : 0);
              for (auto it = now.begin(); it != now.end();) {
                if (absl::Status st = (*it)->Round(n); !st.ok()) {
                  skipped((*it)->spec, st);
                  it = now.erase(it);
                } else {
                  if (rounds > 1) {  // progress, and a slow spell shows in which turn it fell
                    std::fprintf(stderr, "  turn %d/%d %-16s batch %2lld link %-5s: %7.2f tok/s\n", round + 1, rounds,
                                 (*it)->spec.label.c_str(), static_cast<long long>((*it)->spec.batch), link.c_str(),
                                 (*it)->round_tps.back());
                  }
                  ++it;
                }
              }
            }
            for (Measurement* mp : now) {
              Measurement& m = *mp;
              const nlohmann::json r = m.Report();
              runs.push_back(r);
              const RunSpec& spec = m.spec;
              std::fprintf(stderr, "%-11s ctx %6lld batch %2lld link %-5s sel %-12s: %7.2f tok/s  p50 %6.1f ms  hit %.3f  wait %.2f ms/step  carried %.2f\n",
                           spec.label.c_str(), static_cast<long long>(ctx), static_cast<long long>(spec.batch), link.c_str(),
                           spec.selection.c_str(),
                           r["tokens_per_s"].get<double>(), r["step_ms_p50"].get<double>(), r["hit_rate"].get<double>(),
                           r["wait_ms_per_step"].get<double>(), r["carried_fraction"].get<double>());
              if (absl::GetFlag(FLAGS_pcie5_link) && spec.mode == DecodeMode::kSparseCached && link == "inmem" &&
                  spec.batch == 1 && pcie_gbps == 0) {
                // Calibrate the pcie5 link: one sparse layer's miss traffic for one request moves in
                // the time a sparse-cached step spends per layer (so prefetch can just hide a layer's
                // fetch behind a layer's compute; docs/decisions/0016-link-model.md). With no
                // misses at all, the whole budget is the traffic.
                int64_t sparse_layers = 0;
                for (bool swa : model.config.layer_is_swa) sparse_layers += swa ? 0 : 1;
                const double layer_ms = r["step_ms_p50"].get<double>() / model.config.n_layer;
                double bytes = r["urgent_bytes_per_step"].get<double>() / std::max<int64_t>(1, sparse_layers);
                if (bytes <= 0) {
                  bytes = static_cast<double>(budget) / 8 * model.config.n_head_kv * 2 * 8 * model.config.head_dim * 4;
                }
                pcie_gbps = bytes / (layer_ms * 1e6);
                std::fprintf(stderr, "pcie5-equivalent link: %.3f GB/s (%.0f KB of misses per sparse layer in %.3f ms)\n",
                             pcie_gbps, bytes / 1024, layer_ms);
              }
            }
          }
        }  // the forks are released here, with ms
      }
    }
  }
  nlohmann::json doc = {{"model", model.config.name}, {"runs", runs}, {"pcie5_equivalent_gbps", pcie_gbps}, {"steps", steps},
                        {"rounds", rounds}, {"spec_resync", base->spec_resync},
                        {"spec_candidates", candidate_counts.front()},
                        {"threads", threads}, {"decode_threads", decode_threads},
                        {"device_memory_bytes", device_memory}, {"max_batch", max_batches},
                        {"device", device}, {"cuda_graphs", base->cuda_graphs},
                        {"cuda_copy_engine_prefetch", base->cuda_copy_engine_prefetch}, {"weight_bytes", weight_bytes}, {"synthetic_kv", synthetic_kv},
                        {"step_weight_bytes", step_weight_bytes}};
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) std::cout << doc.dump(2) << "\n";
  else std::ofstream(out) << doc.dump(2) << "\n";
  return 0;
}
