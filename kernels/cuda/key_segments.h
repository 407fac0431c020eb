// Key lists as segments for the CUDA attention and landmark-score kernels. The sparse cache's
// lists name every key by pointer (ops.h KeyValueList, KeyScores), but a chunk's 8 keys lie at a
// constant stride in one block, the window's rows at another, and a read's landmarks at a
// third. Sent as runs of (first key, first value, first index, stride), a list crosses PCIe in
// about a quarter of the bytes at 8-token chunks (32 bytes per run against 16 per key), and a
// read's landmarks in one run. The kernels find key i's run by binary search on `start`; the
// keys, and so the bits, are the same.
//
// Host-only packing and a lookup usable on both sides (no CUDA types): key_segments_test runs
// them on the CPU.
#pragma once

#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define DD_HOST_DEVICE __host__ __device__
#else
#define DD_HOST_DEVICE
#endif

namespace dd::kernels::cuda {

// Keys [start, start + n) of a list, n up to the next run's start: key start + j at k + j ×
// stride elements (of the list's type: f32 landmarks, or the KV type), its value at v + j ×
// stride (v null for key-only lists).
struct KeySeg {
  const void* k;
  const void* v;
  int64_t start;
  int64_t stride;
};

// Appends the runs of keys[0, n) (and values, when not null) to *out: a run grows while both
// the next key and the next value lie one common stride (in elements of elem_bytes, any sign)
// past the last. Returns the number of runs appended (0 when n is 0).
template <typename P>
inline int64_t AppendKeySegments(const P* keys, const P* values, int64_t n, int64_t elem_bytes,
                                 std::vector<KeySeg>* out) {
  const auto at = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  const int64_t before = static_cast<int64_t>(out->size());
  for (int64_t i = 0; i < n;) {
    KeySeg s{keys[i], values != nullptr ? values[i] : nullptr, i, 0};
    int64_t j = i + 1;
    if (j < n) {
      const int64_t dk = at(keys[j]) - at(keys[i]);
      const int64_t dv = values != nullptr ? at(values[j]) - at(values[i]) : dk;
      if (dk == dv && dk % elem_bytes == 0) {
        s.stride = dk / elem_bytes;
        while (j < n && at(keys[j]) - at(keys[j - 1]) == dk &&
               (values == nullptr || at(values[j]) - at(values[j - 1]) == dk)) {
          ++j;
        }
      }
    }
    out->push_back(s);
    i = j;
  }
  return static_cast<int64_t>(out->size()) - before;
}

// Key i (and its value) of a list of n_segs runs of elements of T, i within the list.
template <typename T>
DD_HOST_DEVICE inline void KeySegAt(const KeySeg* segs, int64_t n_segs, int64_t i, const T** k, const T** v) {
  int64_t lo = 0, hi = n_segs - 1;  // the last run starting at or before i
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (segs[mid].start <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const KeySeg& s = segs[lo];
  const int64_t off = (i - s.start) * s.stride;
  *k = static_cast<const T*>(s.k) + off;
  *v = s.v != nullptr ? static_cast<const T*>(s.v) + off : nullptr;
}

}  // namespace dd::kernels::cuda
