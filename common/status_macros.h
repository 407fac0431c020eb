// Status helpers shared by every module: RETURN_IF_ERROR / ASSIGN_OR_RETURN.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define DD_CONCAT_INNER(a, b) a##b
#define DD_CONCAT(a, b) DD_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status dd_status_ = (expr);        \
    if (!dd_status_.ok()) return dd_status_;   \
  } while (0)

// ASSIGN_OR_RETURN(auto x, StatusOrExpr()): binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  DD_ASSIGN_OR_RETURN_IMPL(DD_CONCAT(dd_statusor_, __LINE__), lhs, expr)
#define DD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

namespace dd {
// Prefixes a status message with context ("loading model.gguf: ..."), keeping the code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);
}  // namespace dd
