#ifndef ATTENTION_COMMON_STATUS_MACROS_H_
#define ATTENTION_COMMON_STATUS_MACROS_H_

#include <new>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// The project's one pair of error-propagation macros.

#define ATTN_STATUS_CONCAT_INNER_(a, b) a##b
#define ATTN_STATUS_CONCAT_(a, b) ATTN_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define ATTN_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status attn_status_ = (expr);        \
    if (!attn_status_.ok()) return attn_status_; \
  } while (0)

// `lhs = value of rexpr` when OK, otherwise returns its status.
#define ATTN_ASSIGN_OR_RETURN(lhs, rexpr) \
  ATTN_ASSIGN_OR_RETURN_IMPL_(ATTN_STATUS_CONCAT_(attn_statusor_, __LINE__), lhs, rexpr)

#define ATTN_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)  \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace attention {

// Returns f(), an absl::Status or absl::StatusOr<T>, or RESOURCE_EXHAUSTED
// naming `what` when it runs out of memory: an allocation that fails ends the
// one call that made it, not the process.
template <typename F>
auto OutOfMemoryAsStatus(absl::string_view what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory for this request"));
  }
}

}  // namespace attention

#endif  // ATTENTION_COMMON_STATUS_MACROS_H_
