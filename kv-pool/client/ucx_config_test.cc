// UCX_TLS parsing and the shared-memory settings a pool and its workers compare (ucx_config.h).
#include "kv-pool/client/ucx_config.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

// Runs with UCX_TLS (nullptr: unset) and no segment-size variables, restoring them after.
class UcxConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* n : kNames) {
      const char* v = std::getenv(n);
      saved_[n] = v != nullptr ? std::optional<std::string>(v) : std::nullopt;
      unsetenv(n);
    }
  }
  void TearDown() override {
    for (const auto& [n, v] : saved_) {
      if (v) setenv(n.c_str(), v->c_str(), 1);
      else unsetenv(n.c_str());
    }
  }
  static void Tls(const char* v) { v != nullptr ? (void)setenv("UCX_TLS", v, 1) : (void)unsetenv("UCX_TLS"); }
  static constexpr const char* kNames[] = {"UCX_TLS", "UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"};
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST_F(UcxConfigTest, TlsListsExclusionsAndAliases) {
  struct Case {
    const char* tls;
    bool shared, fifo;
  };
  for (const Case& c : {Case{nullptr, true, true}, Case{"", true, true}, Case{"tcp", false, false},
                        Case{"sm,self", true, true}, Case{"tcp,sm", true, true}, Case{"all", true, true},
                        Case{"mm", true, true}, Case{"posix", true, true}, Case{"cma", true, false},
                        Case{"^tcp", true, true}, Case{"^sm", false, false}, Case{"^mm", true, false},
                        Case{"^posix", true, true}, Case{"^posix,sysv,xpmem", true, false}, Case{"rc,ud", false, false}}) {
    Tls(c.tls);
    EXPECT_EQ(SharedMemoryAllowed(), c.shared) << (c.tls ? c.tls : "(unset)");
    EXPECT_EQ(FifoTransportsAllowed(), c.fifo) << (c.tls ? c.tls : "(unset)");
  }
}

TEST_F(UcxConfigTest, SettingsNameTheSegmentsAndCompareOnlyWhereTheyMatter) {
  Tls(nullptr);
  const std::string by_default = UcxSharedMemorySettings();
  EXPECT_NE(by_default.find("UCX_MM_SEG_SIZE=32k"), std::string::npos) << by_default;
  setenv("UCX_MM_SEG_SIZE", "32k", 1);  // written out, the default compares equal
  EXPECT_EQ(UcxSharedMemorySettings(), by_default);
  setenv("UCX_MM_SEG_SIZE", "16k", 1);
  const std::string other = UcxSharedMemorySettings();
  EXPECT_NE(other.find("UCX_MM_SEG_SIZE=16k"), std::string::npos) << other;
  EXPECT_FALSE(UcxSharedMemoryCompatible(other, by_default));
  EXPECT_FALSE(UcxSharedMemoryCompatible("", by_default));  // an older peer reports nothing
  Tls("tcp");  // no FIFO transport: nothing to agree on
  const std::string tcp = UcxSharedMemorySettings();
  EXPECT_NE(tcp.find(std::string(kNoSharedMemory)), std::string::npos) << tcp;
  EXPECT_TRUE(UcxSharedMemoryCompatible(tcp, by_default));
  EXPECT_TRUE(UcxSharedMemoryCompatible(by_default, tcp));
  EXPECT_TRUE(UcxSharedMemoryCompatible(by_default, by_default));
}

}  // namespace
}  // namespace dd::kvpool
