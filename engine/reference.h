#ifndef ATTENTION_ENGINE_REFERENCE_H_
#define ATTENTION_ENGINE_REFERENCE_H_

#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention.h"

namespace attention::internal {

// Query rows ReferenceAttend computes between two polls of its interrupt: the
// oneDNN backend's work item (a block of 64 query rows of one head).
inline constexpr int64_t kReferenceRowsPerPoll = 64;

// The oracle: plain loops with double accumulation, one query row at a time
// (memory O(S) beyond inputs and outputs). `shape` must come from
// ResolveShape(args). `interrupt` (may be null) is polled before each block
// of kReferenceRowsPerPoll query rows of each head; its first non-OK status
// stops the call and is returned.
absl::StatusOr<AttentionResult> ReferenceAttend(
    const AttentionArgs& args, const AttentionShape& shape,
    const std::function<absl::Status()>* interrupt = nullptr);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_REFERENCE_H_
