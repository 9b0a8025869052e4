// RETURN_IF_ERROR / ASSIGN_OR_RETURN: Debian's Abseil (20220623) ships
// neither, so they are defined once here.
#ifndef FULCRUM_COMMON_STATUS_MACROS_H_
#define FULCRUM_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FULCRUM_CONCAT_INNER_(a, b) a##b
#define FULCRUM_CONCAT_(a, b) FULCRUM_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                   \
  do {                                          \
    ::absl::Status fulcrum_status_ = (expr);    \
    if (!fulcrum_status_.ok()) return fulcrum_status_; \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, rexpr) \
  FULCRUM_ASSIGN_OR_RETURN_IMPL_(FULCRUM_CONCAT_(fulcrum_statusor_, __LINE__), lhs, rexpr)

#define FULCRUM_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return statusor.status();              \
  lhs = std::move(statusor).value()

#endif  // FULCRUM_COMMON_STATUS_MACROS_H_
