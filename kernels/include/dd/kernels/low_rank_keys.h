// The reference kernels of the low-rank key cache (dd/backend/ops.h, LowRankKeys;
// docs/decisions/0052-low-rank-key-reconstruction.md): the cpu backend's ops and what the
// other backends are tested against.
#pragma once

#include <cstdint>

#include "dd/backend/ops.h"

namespace dd::kernels {

// Ops::ProjectKeys for rows [begin, end).
void ProjectKeyRows(const backend::LowRankKeys& f, const void* const* rows, const int64_t* positions, int64_t begin,
                    int64_t end, float* out);
// Ops::ReconstructKeys for items [begin, end).
void ReconstructKeyChunks(const backend::LowRankKeys& f, const float* const* coeffs, const int64_t* first,
                          const int32_t* heads, int64_t chunk, int64_t begin, int64_t end, void* const* out);

}  // namespace dd::kernels
