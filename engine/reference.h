#ifndef ATTENTION_ENGINE_REFERENCE_H_
#define ATTENTION_ENGINE_REFERENCE_H_

#include "engine/attention.h"

namespace attention::internal {

// The oracle: plain loops with double accumulation, one query row at a time
// (memory O(S) beyond inputs and outputs). `shape` must come from
// ResolveShape(args).
AttentionResult ReferenceAttend(const AttentionArgs& args, const AttentionShape& shape);

}  // namespace attention::internal

#endif  // ATTENTION_ENGINE_REFERENCE_H_
