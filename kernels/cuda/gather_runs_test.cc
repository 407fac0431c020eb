// Copy-engine gathers' runs (gather_runs.h), on the host.
#include "kernels/cuda/gather_runs.h"

#include <vector>

#include "gtest/gtest.h"

namespace dd::kernels::cuda {
namespace {

TEST(GatherRunsTest, BlocksAdjacentOnBothSidesMergeAndNoOthers) {
  std::vector<GatherRun> runs = {{1, 2, 3}};  // cleared first
  const std::vector<backend::GatherBlock> blocks = {
      {0, 4096}, {64, 4160}, {128, 4224},  // adjacent in both: one run
      {192, 0},                            // source adjacent, destination not
      {512, 64},                           // destination adjacent, source not
      {576, 128},                          // adjacent to the one before: merges with it
      {576, 192},                          // the same source again: not adjacent
  };
  MergeGatherRuns(blocks, 64, &runs);
  const std::vector<GatherRun> want = {{0, 4096, 192}, {192, 0, 64}, {512, 64, 128}, {576, 192, 64}};
  EXPECT_EQ(runs, want);
  MergeGatherRuns({}, 64, &runs);
  EXPECT_TRUE(runs.empty());
}

}  // namespace
}  // namespace dd::kernels::cuda
