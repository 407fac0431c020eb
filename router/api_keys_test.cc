// The API keys file: per-tenant limits parsed and checked, tenants counted.
#include "router/api_keys.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace dd::router {
namespace {

std::string KeysFile(const std::string& json) {
  const std::string path = ::testing::TempDir() + "/keys.json";
  std::ofstream(path) << json;
  chmod(path.c_str(), 0600);
  return path;
}

TEST(ApiKeysTest, PerTenantLimitsAreReadAndChecked) {
  const std::string a(40, 'a'), b(40, 'b'), c(40, 'c');
  auto keys = LoadApiKeys(KeysFile(R"([{"tenant": "t1", "key": ")" + a + R"(", "max_inflight": 3},
                                       {"tenant": "t1", "key": ")" + b + R"("},
                                       {"tenant": "t2", "key": ")" + c + R"(", "shared_prefixes": true}])"));
  ASSERT_TRUE(keys.ok()) << keys.status();
  const ApiAuth auth(*keys, "");
  EXPECT_EQ(auth.tenant_count(), 2);
  EXPECT_EQ(auth.TenantMaxInflight("t1"), 3);
  EXPECT_EQ(auth.TenantMaxInflight("t2"), 0);
  EXPECT_FALSE(auth.SharesPrefixes("t1"));
  EXPECT_TRUE(auth.SharesPrefixes("t2"));
  auto bad = LoadApiKeys(KeysFile(R"([{"tenant": "t", "key": ")" + a + R"(", "shared_prefixes": 1}])"));
  EXPECT_NE(bad.status().message().find("shared_prefixes must be true or false"), std::string::npos) << bad.status();
  for (const char* bad : {"0", "-1", "\"3\"", "1.5", "1000001"}) {
    auto r = LoadApiKeys(KeysFile(R"([{"tenant": "t", "key": ")" + a + R"(", "max_inflight": )" + bad + "}]"));
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("max_inflight must be an integer in [1, 1000000]"), std::string::npos)
        << r.status();
  }
}

}  // namespace
}  // namespace dd::router
