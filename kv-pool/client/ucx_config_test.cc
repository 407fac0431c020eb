// UCX_TLS parsing and the shared-memory settings a pool and its workers compare (ucx_config.h).
#include "kv-pool/client/ucx_config.h"

#include <ucs/debug/log_def.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
  static constexpr const char* kNames[] = {"UCX_TLS",           "UCX_MM_SEG_SIZE",     "UCX_POSIX_SEG_SIZE",
                                           "UCX_SYSV_SEG_SIZE", "UCX_XPMEM_SEG_SIZE",  "UCX_TCP_RX_SEG_SIZE",
                                           "UCX_TCP_TX_SEG_SIZE", "DD_UCX_GPUDIRECT"};
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

// Only shared memory (and self) will carry traffic: then a worker asks for no peer-failure
// handling, which UCX's shared-memory transports lack. UCX's spellings "\\name" and "name:aux"
// name the transport too.
TEST_F(UcxConfigTest, SharedMemoryOnlyKnowsUcxsSpellings) {
  for (const auto& [tls, only] : {std::pair{static_cast<const char*>(nullptr), false}, std::pair{"sm,self", true},
                                  std::pair{"\\posix,self", true}, std::pair{"posix,cma:aux,self", true},
                                  std::pair{"sysv,\\cma", true}, std::pair{"tcp,sm", false},
                                  std::pair{"sm,\\tcp", false}, std::pair{"sm,tcp:aux", false},
                                  std::pair{"^tcp", false}, std::pair{"all", false}}) {
    Tls(tls);
    EXPECT_EQ(SharedMemoryOnly(), only) << (tls != nullptr ? tls : "(unset)");
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

TEST_F(UcxConfigTest, TcpSettingsNameTheReceiveSegmentsAndCompareOnlyWhereTcpIsUsed) {
  Tls(nullptr);
  const std::string by_default = UcxTcpSettings();
  EXPECT_EQ(by_default, "UCX_TCP_RX_SEG_SIZE=1m");
  setenv("UCX_TCP_RX_SEG_SIZE", "1m", 1);  // written out, the default compares equal
  EXPECT_EQ(UcxTcpSettings(), by_default);
  setenv("UCX_TCP_RX_SEG_SIZE", "64k", 1);
  EXPECT_EQ(UcxTcpSettings(), "UCX_TCP_RX_SEG_SIZE=64k");
  EXPECT_FALSE(UcxTcpCompatible(UcxTcpSettings(), by_default));
  unsetenv("UCX_TCP_RX_SEG_SIZE");
  setenv("UCX_TCP_TX_SEG_SIZE", "16k", 1);  // a sender's bcopy fragments: compared too
  EXPECT_EQ(UcxTcpSettings(), "UCX_TCP_RX_SEG_SIZE=1m UCX_TCP_TX_SEG_SIZE=16k");
  EXPECT_FALSE(UcxTcpCompatible(UcxTcpSettings(), by_default));
  unsetenv("UCX_TCP_TX_SEG_SIZE");
  EXPECT_FALSE(UcxTcpCompatible("", by_default));  // an older peer reports nothing
  for (const char* tls : {"sm,self", "^tcp", "rc,ud"}) {  // no tcp: nothing to agree on
    Tls(tls);
    EXPECT_EQ(UcxTcpSettings(), std::string(kNoTcp)) << tls;
    EXPECT_TRUE(UcxTcpCompatible(UcxTcpSettings(), by_default)) << tls;
    EXPECT_TRUE(UcxTcpCompatible(by_default, UcxTcpSettings())) << tls;
    EXPECT_TRUE(UcxTcpCompatible("", UcxTcpSettings())) << tls;
  }
  Tls("tcp,sm");
  EXPECT_EQ(UcxTcpSettings(), by_default);
}

TEST_F(UcxConfigTest, TcpIsLeftOutOfAnyTransportList) {
  struct Case {
    const char* tls;
    const char* without;  // nullptr: nothing would be left
  };
  for (const Case& c : {Case{"", "^tcp"}, Case{"all", "^tcp"}, Case{"tcp,all", "^tcp"}, Case{"^rc", "^rc,tcp"},
                        Case{"^tcp", "^tcp"}, Case{"^rc,tcp", "^rc,tcp"}, Case{"tcp,sm,self", "sm,self"},
                        Case{"sm,self", "sm,self"}, Case{"rc,ud", "rc,ud"}, Case{"tcp", nullptr},
                        Case{"tcp,self", nullptr}, Case{"^all", "^tcp"}, Case{"\\tcp,sm", "sm"},
                        Case{"sm,tcp:aux", "sm"}, Case{"^\\tcp", "^\\tcp"}}) {
    absl::StatusOr<std::string> got = TlsWithoutTcp(c.tls);
    if (c.without == nullptr) {
      EXPECT_FALSE(got.ok()) << c.tls << " -> " << *got;
    } else {
      EXPECT_EQ(got.value_or("(error)"), c.without) << c.tls;
    }
  }
  for (const char* tls : {"tcp,sm", "\\tcp", "sm,tcp:aux"}) {
    Tls(tls);
    EXPECT_TRUE(TlsNamesTcp()) << tls;
  }
  for (const char* tls : {static_cast<const char*>(nullptr), "all", "^tcp", "^rc", "sm,self"}) {
    Tls(tls);
    EXPECT_FALSE(TlsNamesTcp()) << (tls ? tls : "(unset)");
  }
}

// An active-message context from ReadUcxConfig(tcp), or an error; the caller cleans it up.
absl::StatusOr<ucp_context_h> AmContext(bool tcp) {
  absl::StatusOr<ucp_config_t*> config = ReadUcxConfig(tcp);
  if (!config.ok()) return config.status();
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, *config, &context);
  ucp_config_release(*config);
  if (st != UCS_OK) return absl::InternalError(absl::StrCat("ucp_init: ", ucs_status_string(st)));
  return context;
}

// UCX's warnings and errors while a test runs (a setting no transport takes is only a warning).
std::vector<std::string>* ucx_complaints = nullptr;
ucs_log_func_rc_t RecordComplaint(const char*, unsigned, const char*, ucs_log_level_t level,
                                  const ucs_log_component_config_t*, const char* format, va_list ap) {
  if (level > UCS_LOG_LEVEL_WARN || ucx_complaints == nullptr) return UCS_LOG_FUNC_RC_CONTINUE;
  char line[512];
  std::vsnprintf(line, sizeof(line), format, ap);
  ucx_complaints->push_back(line);
  return UCS_LOG_FUNC_RC_STOP;
}

// The defaults reach UCX: a worker made from ReadUcxConfig draws no complaint, whatever UCX_TLS
// loads (a key no transport knows, e.g. "TCP_RX_SEG_SIZE" for tcp's "RX_SEG_SIZE", is only
// warned about, and the transport keeps its own default).
TEST_F(UcxConfigTest, TheDefaultsAreSettingsUcxTakes) {
  std::vector<std::string> complaints;
  ucx_complaints = &complaints;
  ucs_log_push_handler(&RecordComplaint);
  for (const auto& [tls, tcp] : {std::pair{static_cast<const char*>(nullptr), true}, std::pair{"tcp", true},
                                 std::pair{"sm,self", true}, std::pair{"tcp,sm,self", true},
                                 std::pair{static_cast<const char*>(nullptr), false}, std::pair{"tcp,sm,self", false}}) {
    Tls(tls);
    const std::string name = absl::StrCat(tls != nullptr ? tls : "(unset)", tcp ? "" : ", tcp left out");
    absl::StatusOr<ucp_context_h> context = AmContext(tcp);
    ASSERT_TRUE(context.ok()) << name << ": " << context.status();
    ucp_worker_params_t wp{};
    ucp_worker_h worker = nullptr;
    EXPECT_EQ(ucp_worker_create(*context, &wp, &worker), UCS_OK) << name;
    if (worker != nullptr) ucp_worker_destroy(worker);
    ucp_cleanup(*context);
    EXPECT_TRUE(complaints.empty()) << name << ": " << (complaints.empty() ? "" : complaints.front());
    complaints.clear();
  }
  ucs_log_pop_handler();
  ucx_complaints = nullptr;
}

// Whatever form UCX_TLS takes, a context read with tcp left out has no tcp resource (UCX's own
// list of what it loaded), and one read with tcp has it: the check both ends fail closed on.
TEST_F(UcxConfigTest, TcpLeftOutMeansNoTcpResource) {
  auto loads_tcp = [](bool tcp) -> std::optional<bool> {
    absl::StatusOr<ucp_context_h> context = AmContext(tcp);
    if (!context.ok()) return std::nullopt;
    const bool has = UcxContextHasTcp(*context);
    ucp_cleanup(*context);
    return has;
  };
  Tls(nullptr);
  EXPECT_EQ(loads_tcp(true), std::optional<bool>(true));
  for (const char* tls : {static_cast<const char*>(nullptr), "all", "^all", "^sm", "tcp,sm,self", "\\tcp,sm,self",
                          "sm,self,tcp:aux"}) {
    Tls(tls);
    EXPECT_EQ(loads_tcp(false), std::optional<bool>(false)) << (tls ? tls : "(unset)");
  }
}

// The tcp segment as UCX reads sizes: the default, a setting, one UCX would refuse.
TEST_F(UcxConfigTest, TcpSegmentBytesAsUcxReadsThem) {
  EXPECT_EQ(UcxTcpSegmentBytes(), int64_t{1} << 20);
  for (const auto& [text, bytes] : {std::pair{"256k", int64_t{256} << 10}, std::pair{"64K", int64_t{64} << 10},
                                    std::pair{"2m", int64_t{2} << 20}, std::pair{"9000", int64_t{9000}},
                                    std::pair{"lots", int64_t{0}}, std::pair{"", int64_t{0}}}) {
    setenv("UCX_TCP_RX_SEG_SIZE", text, 1);
    EXPECT_EQ(UcxTcpSegmentBytes(), bytes) << text;
  }
}

// A FIFO segment over 65535 bytes kills the receiver inside UCX (ucx_config.h): refused by
// ReadUcxConfig, naming the variable and its value, wherever UCX_TLS allows the FIFO transports.
TEST_F(UcxConfigTest, SegmentsTheFifoCannotCarryAreRefused) {
  for (const char* name : {"UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_XPMEM_SEG_SIZE"}) {
    // Sizes read as UCX reads them: 63K is 64512 bytes, 64K is 65536.
    for (const char* ok : {"32k", "65535", "63K", "8256"}) {
      setenv(name, ok, 1);
      EXPECT_TRUE(CheckUcxSegmentSizes().ok()) << name << "=" << ok << ": " << CheckUcxSegmentSizes();
    }
    for (const char* big : {"64k", "64K", "65536", "1m", "inf"}) {
      setenv(name, big, 1);
      absl::StatusOr<ucp_config_t*> config = ReadUcxConfig();
      ASSERT_FALSE(config.ok()) << name << "=" << big;
      EXPECT_EQ(config.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(config.status().message().find(absl::StrCat(name, "=", big)), std::string::npos) << config.status();
      Tls("tcp");  // no FIFO transport: the setting reaches nothing
      EXPECT_TRUE(CheckUcxSegmentSizes().ok()) << name << "=" << big << " with UCX_TLS=tcp";
      Tls(nullptr);
    }
    unsetenv(name);
  }
  EXPECT_TRUE(CheckUcxSegmentSizes().ok());
}

// The transport of an endpoint's active messages, from UCX's own description of its lanes:
// tcp when only tcp is allowed, a shared-memory transport on one host when it is.
TEST_F(UcxConfigTest, AnEndpointNamesTheTransportOfItsActiveMessages) {
  for (const auto& [tls, want_tcp] : {std::pair{"tcp", true}, std::pair{"sm,self", false}}) {
    Tls(tls);
    absl::StatusOr<ucp_context_h> context = AmContext(true);
    ASSERT_TRUE(context.ok()) << tls << ": " << context.status();
    ucp_worker_params_t wp{};
    ucp_worker_h a = nullptr, b = nullptr;
    ASSERT_EQ(ucp_worker_create(*context, &wp, &a), UCS_OK);
    ASSERT_EQ(ucp_worker_create(*context, &wp, &b), UCS_OK);
    ucp_address_t* address = nullptr;
    size_t length = 0;
    ASSERT_EQ(ucp_worker_get_address(b, &address, &length), UCS_OK);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = address;
    ucp_ep_h e = nullptr;
    ASSERT_EQ(ucp_ep_create(a, &ep, &e), UCS_OK) << tls;
    const std::string t = UcxAmTransport(e);
    if (want_tcp) {
      EXPECT_EQ(t, "tcp");
    } else {
      EXPECT_TRUE(t == "posix" || t == "sysv" || t == "cma" || t == "xpmem") << "\"" << t << "\"";
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(e, &p);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(a);
    }
    const bool closed = r == nullptr || UCS_PTR_IS_ERR(r) || ucp_request_check_status(r) != UCS_INPROGRESS;
    ASSERT_TRUE(closed) << tls << ": a forced close did not complete in 10 s";  // leaks the workers, not UB
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
    ucp_worker_release_address(b, address);
    ucp_worker_destroy(a);
    ucp_worker_destroy(b);
    ucp_cleanup(*context);
  }
}

// Gathers land in CUDA memory only over one-sided gets, only where UCX reports CUDA memory,
// and not when the operator turned it off.
TEST_F(UcxConfigTest, DeviceDestinationsOnlyOverRmaWhereUcxReachesCuda) {
  const uint64_t host = UCS_BIT(UCS_MEMORY_TYPE_HOST), cuda = UCS_BIT(UCS_MEMORY_TYPE_CUDA);
  EXPECT_TRUE(UcxCudaDestinations(true, host | cuda, true));
  EXPECT_FALSE(UcxCudaDestinations(false, host | cuda, true)) << "active messages: eager replies are copied on the host";
  EXPECT_FALSE(UcxCudaDestinations(true, host, true)) << "a UCX without CUDA";
  EXPECT_FALSE(UcxCudaDestinations(true, host | UCS_BIT(UCS_MEMORY_TYPE_CUDA_MANAGED), true)) << "managed only";
  EXPECT_FALSE(UcxCudaDestinations(true, host | cuda, false)) << "DD_UCX_GPUDIRECT not on";
  // What this machine's UCX reports: host memory always; CUDA only from a UCX built with it.
  absl::StatusOr<ucp_context_h> context = AmContext(true);
  ASSERT_TRUE(context.ok()) << context.status();
  const uint64_t types = UcxMemoryTypes(*context);
  ucp_cleanup(*context);
  EXPECT_NE(types & host, 0u) << types;
  std::printf("this UCX reports CUDA memory: %s\n", (types & cuda) != 0 ? "yes" : "no");
}

TEST_F(UcxConfigTest, GpuDirectIsOffUnlessTurnedOnAndABadValueIsNamed) {
  EXPECT_EQ(UcxGpuDirectAllowed().value_or(true), false) << "unset";
  setenv("DD_UCX_GPUDIRECT", "on", 1);
  EXPECT_EQ(UcxGpuDirectAllowed().value_or(false), true);
  setenv("DD_UCX_GPUDIRECT", "off", 1);
  EXPECT_EQ(UcxGpuDirectAllowed().value_or(true), false);
  setenv("DD_UCX_GPUDIRECT", "yes", 1);
  const absl::StatusOr<bool> bad = UcxGpuDirectAllowed();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("DD_UCX_GPUDIRECT 'yes'"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace dd::kvpool
