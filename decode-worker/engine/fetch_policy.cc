#include "decode-worker/engine/fetch_policy.h"

namespace dd::engine {

std::unique_ptr<FetchPolicy> MakeFetchPolicy(const FetchContext& ctx) {
  switch (ctx.options.fetch) {
    case KvFetch::kOnDemand: return NewOnDemandFetch(ctx);
    case KvFetch::kResident: return NewResidentFetch(ctx);
  }
  return NewOnDemandFetch(ctx);
}

}  // namespace dd::engine
