#include "decode-worker/engine/selection_model.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dd::engine {
namespace {

// splitmix64: a fast, well-mixed stream from one 64-bit state.
class Rng {
 public:
  explicit Rng(uint64_t state) : state_(state) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0.
  int64_t Below(int64_t n) {
    return static_cast<int64_t>((static_cast<unsigned __int128>(Next()) * static_cast<uint64_t>(n)) >> 64);
  }

 private:
  uint64_t state_;
};

// One stream per (seed, key, purpose): each field mixed in turn.
Rng StreamFor(uint64_t seed, const SelectionModel::Key& key, uint64_t purpose) {
  Rng mix(seed ^ 0x6a09e667f3bcc909ULL);
  uint64_t h = mix.Next();
  for (uint64_t v : {static_cast<uint64_t>(key.seq), static_cast<uint64_t>(key.layer),
                     static_cast<uint64_t>(key.head), static_cast<uint64_t>(key.pos), purpose}) {
    Rng step(h ^ v);
    h = step.Next();
  }
  return Rng(h);
}

// `count` chunks taken uniformly from `from` (all of them if it holds fewer), appended to *out.
void TakeSome(Rng& rng, std::vector<int64_t> from, int64_t count, std::vector<int64_t>* out) {
  const int64_t n = static_cast<int64_t>(from.size());
  count = std::min(count, n);
  for (int64_t i = 0; i < count; ++i) {  // partial Fisher-Yates
    std::swap(from[i], from[i + rng.Below(n - i)]);
    out->push_back(from[i]);
  }
}

// `count` distinct chunks of [begin, end) outside `exclude` (ascending), uniform, appended to
// *out (all there are if fewer).
void TakeNew(Rng& rng, int64_t begin, int64_t end, const std::vector<int64_t>& exclude, int64_t count,
             std::vector<int64_t>* out) {
  const int64_t n = end - begin;
  const int64_t inside = static_cast<int64_t>(std::distance(std::lower_bound(exclude.begin(), exclude.end(), begin),
                                                            std::lower_bound(exclude.begin(), exclude.end(), end)));
  const int64_t free = n - inside;
  if (count <= 0 || free <= 0) return;
  if (free <= 4 * count) {  // a crowded range: draw from the list of free chunks
    std::vector<int64_t> candidates;
    candidates.reserve(free);
    for (int64_t c = begin; c < end; ++c) {
      if (!std::binary_search(exclude.begin(), exclude.end(), c)) candidates.push_back(c);
    }
    TakeSome(rng, std::move(candidates), count, out);
    return;
  }
  // A sparse range (at least 4 free chunks per one wanted): rejection, a few rounds at most.
  std::vector<int64_t> picks;
  picks.reserve(count);
  while (static_cast<int64_t>(picks.size()) < count) {
    for (int64_t need = count - static_cast<int64_t>(picks.size()); need > 0;) {
      const int64_t c = begin + rng.Below(n);
      if (std::binary_search(exclude.begin(), exclude.end(), c)) continue;
      picks.push_back(c);
      --need;
    }
    std::sort(picks.begin(), picks.end());
    picks.erase(std::unique(picks.begin(), picks.end()), picks.end());
  }
  out->insert(out->end(), picks.begin(), picks.end());
}

int64_t Part(double fraction, int64_t n) { return std::min<int64_t>(n, std::llround(fraction * static_cast<double>(n))); }

}  // namespace

absl::StatusOr<SelectionModel> SelectionModel::Parse(absl::string_view spec) {
  SelectionModel m;
  if (spec.empty() || spec == "off") return m;
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  if (parts.size() < 2 || parts.size() > 4) {
    return absl::InvalidArgumentError(absl::StrCat("selection model '", spec,
                                                   "': want OVERLAP:HIT[:RESIDENT_WASTE[:SEED]], e.g. 0.7:0.95:0.4"));
  }
  const char* names[] = {"overlap", "hit rate", "resident waste"};
  double* fields[] = {&m.overlap, &m.hit_rate, &m.resident_waste};
  for (size_t i = 0; i < std::min<size_t>(3, parts.size()); ++i) {
    if (!absl::SimpleAtod(parts[i], fields[i]) || !(*fields[i] >= 0.0 && *fields[i] <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat("selection model '", spec, "': ", names[i], " '", parts[i],
                                                     "' is not a fraction in [0, 1]"));
    }
  }
  if (parts.size() == 4 && !absl::SimpleAtoi(parts[3], &m.seed)) {
    return absl::InvalidArgumentError(
        absl::StrCat("selection model '", spec, "': seed '", parts[3], "' is not an unsigned integer"));
  }
  m.enabled = true;
  return m;
}

std::string SelectionModel::ToString() const {
  if (!enabled) return "off";
  return absl::StrCat(overlap, ":", hit_rate, ":", resident_waste, ":", seed);
}

std::vector<int64_t> SelectionModel::First(const Key& key, int64_t begin, int64_t end, int64_t k) const {
  std::vector<int64_t> out;
  Rng rng = StreamFor(seed, key, 1);
  TakeNew(rng, begin, end, {}, k, &out);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> SelectionModel::Next(const Key& key, const std::vector<int64_t>& now, int64_t begin, int64_t end,
                                          int64_t k) const {
  if (end - begin <= k) {
    std::vector<int64_t> all;
    for (int64_t c = begin; c < end; ++c) all.push_back(c);
    return all;
  }
  Rng rng = StreamFor(seed, key, 2);
  const int64_t size = std::max<int64_t>(k, static_cast<int64_t>(now.size()));
  std::vector<int64_t> out;
  out.reserve(size);
  TakeSome(rng, now, Part(overlap, static_cast<int64_t>(now.size())), &out);
  TakeNew(rng, begin, end, now, size - static_cast<int64_t>(out.size()), &out);
  // A range too crowded for that many new chunks: the rest from what `now` dropped.
  if (static_cast<int64_t>(out.size()) < size) {
    std::vector<int64_t> kept(out), dropped;
    std::sort(kept.begin(), kept.end());
    std::set_difference(now.begin(), now.end(), kept.begin(), kept.end(), std::back_inserter(dropped));
    TakeSome(rng, std::move(dropped), size - static_cast<int64_t>(out.size()), &out);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> SelectionModel::Predict(const Key& key, const std::vector<int64_t>& now,
                                             const std::vector<int64_t>& next, int64_t begin, int64_t end) const {
  Rng rng = StreamFor(seed, key, 3);
  const int64_t size = static_cast<int64_t>(next.size());
  std::vector<int64_t> kept, added, out;
  std::set_intersection(next.begin(), next.end(), now.begin(), now.end(), std::back_inserter(kept));
  std::set_difference(next.begin(), next.end(), now.begin(), now.end(), std::back_inserter(added));
  const int64_t hits = Part(hit_rate, size);
  const int64_t from_kept = std::min<int64_t>(hits, static_cast<int64_t>(kept.size()));
  out.reserve(size);
  TakeSome(rng, std::move(kept), from_kept, &out);
  TakeSome(rng, std::move(added), hits - from_kept, &out);
  // The mispredictions: some the step cache still holds, the rest fetched for nothing.
  const int64_t wrong = size - static_cast<int64_t>(out.size());
  std::vector<int64_t> dropped, either;
  std::set_difference(now.begin(), now.end(), next.begin(), next.end(), std::back_inserter(dropped));
  TakeSome(rng, std::move(dropped), Part(resident_waste, wrong), &out);
  std::set_union(now.begin(), now.end(), next.begin(), next.end(), std::back_inserter(either));
  TakeNew(rng, begin, end, either, size - static_cast<int64_t>(out.size()), &out);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace dd::engine
