#ifndef ATTENTION_COMMON_METADATA_H_
#define ATTENTION_COMMON_METADATA_H_

// gRPC metadata the client and the server agree on (docs/sessions.md,
// "Sessions across replicas").

namespace attention {

// Sent by clients on session calls: the session's id, or a group id the
// caller chooses for sessions it keeps together. A proxy hashing on it sends
// every call of a session to one replica; the server ignores it.
inline constexpr char kAffinityHeader[] = "attention-affinity";

// Sent by the server in the initial metadata of its answers: the name of the
// replica that served the call (--replica_name; hostname:port by default).
inline constexpr char kReplicaHeader[] = "attention-replica";

}  // namespace attention

#endif  // ATTENTION_COMMON_METADATA_H_
