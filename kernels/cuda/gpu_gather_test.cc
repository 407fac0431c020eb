// The host -> device chunk gathers (gather_cuda.h): argument checks everywhere; byte-exact copies
// on both paths when a CUDA device is present (skipped, saying so, when none is).
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/gather_cuda.h"
#include "gtest/gtest.h"

namespace dd::kernels::cuda {
namespace {

TEST(GatherArgsTest, RefusesWhatTheCopiesCannotDo) {
  alignas(16) static char buf[64];
  EXPECT_EQ(CheckGatherArgs(buf, 1, 16, buf), cudaSuccess);
  EXPECT_EQ(CheckGatherArgs(buf, -1, 16, buf), cudaErrorInvalidValue);
  EXPECT_EQ(CheckGatherArgs(buf, 1, 0, buf), cudaErrorInvalidValue);
  EXPECT_EQ(CheckGatherArgs(buf, 1, 24, buf), cudaErrorInvalidValue);  // not whole 16-byte loads
  EXPECT_EQ(CheckGatherArgs(buf + 8, 1, 16, buf), cudaErrorInvalidValue);
  EXPECT_EQ(CheckGatherArgs(buf, 1, 16, buf + 4), cudaErrorInvalidValue);
  EXPECT_EQ(CheckGatherArgs(nullptr, 1, 16, buf), cudaErrorInvalidValue);
  EXPECT_EQ(CheckGatherArgs(nullptr, 0, 16, nullptr), cudaSuccess);  // nothing to copy
}

TEST(GatherArgsTest, CopyEngineRefusesMisalignedOffsetsBeforeCallingCuda) {
  alignas(16) static char buf[64];
  CopyBatchScratch scratch;
  const int64_t offsets[] = {0, 8};
  // A non-null stream handle is never used: the offset check fails first.
  const auto some_stream = reinterpret_cast<cudaStream_t>(0x1000);
  EXPECT_EQ(GatherChunksCopyEngine(buf, sizeof buf, offsets, 2, 16, buf, false, &scratch, some_stream),
            cudaErrorInvalidValue);
  // A chunk past the source's end, and the legacy stream, are refused the same way.
  const int64_t past[] = {0, 64};
  EXPECT_EQ(GatherChunksCopyEngine(buf, sizeof buf, past, 2, 16, buf, false, &scratch, some_stream),
            cudaErrorInvalidValue);
  EXPECT_EQ(GatherChunksCopyEngine(buf, sizeof buf, offsets, 1, 16, buf, false, &scratch, cudaStreamLegacy),
            cudaErrorInvalidValue);
  int64_t copies = -1;
  EXPECT_EQ(GatherChunksCopyEngine(buf, sizeof buf, offsets, 0, 16, buf, false, &scratch, nullptr, &copies),
            cudaSuccess);
  EXPECT_EQ(copies, 0);
}

class GatherCopyTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(GatherCopyTest, BothPathsCopyTheListedChunksExactly) {
  if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: the gathers are not run here";
  const int64_t chunk = GetParam();
  const int64_t slots = 512, count = 300;
  char* host = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), slots * chunk, cudaHostAllocMapped), cudaSuccess);
  std::mt19937 rng(static_cast<uint32_t>(chunk));
  for (int64_t i = 0; i < slots * chunk; ++i) host[i] = static_cast<char>(rng());
  // Random chunks, a repeated one, and a run of adjacent ones (which the copy engine merges).
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < count - 10; ++i) offsets.push_back(static_cast<int64_t>(rng() % slots) * chunk);
  offsets.push_back(offsets[3]);
  for (int64_t i = 0; i < 9; ++i) offsets.push_back((100 + i) * chunk);
  std::vector<char> expected(count * chunk), got(count * chunk);
  for (int64_t i = 0; i < count; ++i) std::memcpy(&expected[i * chunk], host + offsets[i], chunk);
  char* dst = nullptr;
  int64_t* offsets_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dst, count * chunk), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&offsets_dev, count * sizeof(int64_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(offsets_dev, offsets.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice), cudaSuccess);
  // The legacy stream's copies and memsets are not ordered with the non-blocking stream below.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  void* host_dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&host_dev, host, 0), cudaSuccess);
  for (int blocks : {1, 3, 0}) {
    ASSERT_EQ(cudaMemset(dst, 0x5A, count * chunk), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(GatherChunksOnDevice(host_dev, offsets_dev, count, chunk, dst, blocks, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), dst, count * chunk, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), count * chunk), 0) << "device path, blocks " << blocks;
  }
  for (bool hint : {false, true}) {
    ASSERT_EQ(cudaMemset(dst, 0x5A, count * chunk), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    CopyBatchScratch scratch;
    int64_t copies = 0;
    ASSERT_EQ(GatherChunksCopyEngine(host, slots * chunk, offsets.data(), count, chunk, dst, hint, &scratch, s, &copies),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), dst, count * chunk, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), count * chunk), 0) << "copy engines, hint " << hint;
    EXPECT_LE(copies, count - 8);  // the 9 adjacent chunks went as one copy
  }
  cudaStreamDestroy(s);
  cudaFree(offsets_dev);
  cudaFree(dst);
  cudaFreeHost(host);
}

// 16 B (one load per chunk), 48 B (lanes idle), 4 KiB (the design's chunk), and 4 KiB + 16
// (a remainder past the kernel's 4 KiB per round of loads).
INSTANTIATE_TEST_SUITE_P(ChunkBytes, GatherCopyTest, ::testing::Values(16, 48, 4096, 4112));

}  // namespace
}  // namespace dd::kernels::cuda
