// The shape bounds checked before a JSON body is parsed (json_bounds.h).
#include "common/json_bounds.h"

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dd {
namespace {

TEST(JsonBoundsTest, DepthIsCountedOutsideStringsOnly) {
  const JsonBounds b{.max_depth = 3, .max_values = 1000};
  EXPECT_TRUE(CheckJsonBounds(R"({"a": [[1, 2], [3]]})", b).ok());
  EXPECT_EQ(CheckJsonBounds(R"({"a": [[[1]]]})", b).code(), absl::StatusCode::kInvalidArgument);
  // Brackets inside strings, also after escaped quotes and backslashes, are text.
  EXPECT_TRUE(CheckJsonBounds(R"({"a": "[[[[{{{{", "b": "\"[[[[", "c": "\\", "d": [1]})", b).ok());
  EXPECT_EQ(CheckJsonBounds(R"({"c": "\\", "d": [[[1]]]})", b).code(), absl::StatusCode::kInvalidArgument);
}

TEST(JsonBoundsTest, ValuesAreBounded) {
  const JsonBounds b{.max_depth = 8, .max_values = 10};
  EXPECT_TRUE(CheckJsonBounds("[1,2,3,4,5,6,7,8]", b).ok());  // the array and 7 commas
  EXPECT_EQ(CheckJsonBounds("[1,2,3,4,5,6,7,8,9,10,11]", b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckJsonBounds(R"(["1,2,3,4,5,6,7,8,9,10,11"])", b).ok());  // commas in a string
}

// Every text within the bounds parses into a document no larger than the bounds say: the
// check counts what the parser builds (a deep text at the bound, a wide one at the bound).
TEST(JsonBoundsTest, TextsAtTheBoundsParse) {
  const JsonBounds b;
  const std::string deep = std::string(b.max_depth, '[') + std::string(b.max_depth, ']');
  ASSERT_TRUE(CheckJsonBounds(deep, b).ok());
  EXPECT_FALSE(nlohmann::json::parse(deep, nullptr, false).is_discarded());
  EXPECT_FALSE(CheckJsonBounds("[" + deep + "]", b).ok());
  std::string wide = "[0";
  for (int64_t i = 1; i < b.max_values - 1; ++i) wide += ",0";
  wide += "]";
  ASSERT_TRUE(CheckJsonBounds(wide, b).ok());
  EXPECT_EQ(nlohmann::json::parse(wide).size(), static_cast<size_t>(b.max_values - 1));
  EXPECT_FALSE(CheckJsonBounds(wide.substr(0, wide.size() - 1) + ",0,0]", b).ok());
}

}  // namespace
}  // namespace dd
