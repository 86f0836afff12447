// Linked into the executables (tests, and the programs tests start) of the
// ATTENTION_SANITIZE=thread build only: CMakeLists.txt, attention_tsan_absl_sync.
//
// ThreadSanitizer sees a lock only when the code taking it is instrumented.
// Debian's Abseil is not, so to TSan every absl::Mutex (ours, and gRPC's,
// whose gpr_mu and grpc_core::Mutex are absl::Mutex) is invisible, and every
// access guarded by one is reported as a race. This file defines the
// synchronisation entry points of libabsl_synchronization itself: the
// executable's definitions take precedence over the library's for every
// caller, libgrpc included (the executable is linked with --export-dynamic).
// Each calls the library's own function, found with dlsym(RTLD_NEXT), and
// tells TSan what it did with the __tsan_mutex_* annotations Abseil makes
// when it is built with TSan.
//
// It does the same for the gRPC core functions that hand a batch's tag from
// one thread to another (below), and sets TSan's default options
// (__tsan_default_options).
//
// Assumed, as everywhere in this project: Await and CondVar::Wait are called
// with the mutex held in writer mode.

#include <dlfcn.h>
#include <grpc/grpc.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define ATTN_TSAN_STR2(x) #x
#define ATTN_TSAN_STR(x) ATTN_TSAN_STR2(x)

// The next definition of `name` after this executable's: the library's.
template <typename F>
F Next(const std::string& name, const char* library) {
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found in %s\n", name.c_str(), library);
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

// The library's definition of the function whose mangled name is
// "_Z" + `nested` + "4absl<inline namespace>" + `rest`; `nested` is "N", or
// "NK" for a const member function.
template <typename F>
F Real(const char* nested, const char* rest) {
  const std::string ns = ATTN_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return Next<F>(std::string("_Z") + nested + "4absl" + std::to_string(ns.size()) + ns + rest,
                 "libabsl_synchronization");
}

// How many of the functions below are running on this thread. The library's
// functions call each other (WaitWithTimeout calls WaitWithDeadline,
// Notification::Notify locks a Mutex, ...), and those nested calls reach the
// definitions below too: only the outermost call is annotated.
thread_local int depth = 0;

struct Nesting {
  Nesting() : outermost(depth++ == 0) {}
  ~Nesting() { --depth; }
  Nesting(const Nesting&) = delete;
  Nesting& operator=(const Nesting&) = delete;
  const bool outermost;
};

// Declares `real`, the library's definition, and `annotate`, whether this is
// the outermost call.
#define ATTN_REAL_WITH(type, nested, rest)           \
  static const auto real = Real<type>(nested, rest); \
  const Nesting nesting;                             \
  const bool annotate = nesting.outermost
#define ATTN_REAL(type, rest) ATTN_REAL_WITH(type, "N", rest)
#define ATTN_REAL_CONST(type, rest) ATTN_REAL_WITH(type, "NK", rest)

constexpr unsigned kRead = __tsan_mutex_read_lock;
constexpr unsigned kTry = __tsan_mutex_try_lock;
constexpr unsigned kTryFailed = __tsan_mutex_try_lock_failed;

// The annotations around a call that takes `mu` (`flags`: kRead, kTry). For
// a try-lock, `call` returns whether it took the mutex; otherwise the mutex
// is held when it returns (LockWhenWithTimeout's result is the condition's).
template <typename F>
auto Locking(bool annotate, absl::Mutex* mu, unsigned flags, F call) {
  if (annotate) __tsan_mutex_pre_lock(mu, flags);
  auto result = call();
  if (annotate) {
    const bool failed = (flags & kTry) != 0 && !static_cast<bool>(result);
    __tsan_mutex_post_lock(mu, flags | (failed ? kTryFailed : 0), 0);
  }
  return result;
}

template <typename F>
void Unlocking(bool annotate, absl::Mutex* mu, unsigned flags, F call) {
  if (annotate) __tsan_mutex_pre_unlock(mu, flags);
  call();
  if (annotate) __tsan_mutex_post_unlock(mu, flags);
}

// Around a call that releases `mu` and takes it again before returning
// (Await, CondVar::Wait). TSan ignores the thread's accesses in between:
// Abseil evaluates the wait's Condition there, with the mutex held.
template <typename F>
auto Reacquiring(bool annotate, absl::Mutex* mu, F call) {
  Unlocking(annotate, mu, 0, [] {});
  return Locking(annotate, mu, 0, call);
}

// For Notification and BlockingCounter, whose waits end when another thread
// signals: what that thread did before signalling happens before the wait
// returns (when it returns true: a timed wait may give up).
template <typename F>
auto Signalling(bool annotate, const void* object, F call) {
  if (annotate) __tsan_release(const_cast<void*>(object));
  return call();
}

template <typename F>
auto Waiting(bool annotate, const void* object, F call) {
  auto result = call();
  if (annotate && static_cast<bool>(result)) __tsan_acquire(const_cast<void*>(object));
  return result;
}

// `call` made to return true, for the helpers above.
#define ATTN_VOID(call) \
  [&] {                 \
    call;               \
    return true;        \
  }

}  // namespace

// TSan's options unless TSAN_OPTIONS overrides them: stop at the first report
// (a test that races fails); ignore the memcpy, new and delete that
// uninstrumented libraries (gRPC) call, as TSan cannot see how those
// libraries order them (atomics, lock-free queues); a longer history than the
// default, so that both stacks of a report are kept (suppressions match
// either); the suppressions file.
extern "C" const char* __tsan_default_options() {
  return "halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 "
         "history_size=7 suppressions=" ATTENTION_TSAN_SUPPRESSIONS;
}

// gRPC's completion queues. A batch of operations started on a call completes
// on whichever thread takes its tag from the queue (for the callback API, a
// thread of gRPC's that then runs the tag's callback). What the starting
// thread did before grpc_call_start_batch (setting up the tag's callback, the
// messages to send) happens before that, ordered inside the core, which TSan
// cannot see. libgrpc++ calls these functions through the dynamic linker, so
// the definitions below take the calls, as for Abseil.
// The tag is the address TSan orders on: released when a batch (or a server's
// request for a new call) is started with it, acquired when the queue hands
// it out.

namespace {

// libgrpc's definition of the C function `name`.
template <typename F>
F RealC(const char* name) {
  return Next<F>(name, "libgrpc");
}

grpc_event Handed(grpc_event event) {
  if (event.type == GRPC_OP_COMPLETE && event.tag != nullptr) __tsan_acquire(event.tag);
  return event;
}

}  // namespace

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                      void* reserved) {
  static const auto real = RealC<decltype(&grpc_call_start_batch)>("grpc_call_start_batch");
  if (tag != nullptr) __tsan_release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_call_error grpc_server_request_call(grpc_server* server, grpc_call** call,
                                         grpc_call_details* details,
                                         grpc_metadata_array* request_metadata,
                                         grpc_completion_queue* cq_bound_to_call,
                                         grpc_completion_queue* cq_for_notification,
                                         void* tag_new) {
  static const auto real = RealC<decltype(&grpc_server_request_call)>("grpc_server_request_call");
  if (tag_new != nullptr) __tsan_release(tag_new);
  return real(server, call, details, request_metadata, cq_bound_to_call, cq_for_notification,
              tag_new);
}

grpc_call_error grpc_server_request_registered_call(grpc_server* server, void* registered_method,
                                                    grpc_call** call, gpr_timespec* deadline,
                                                    grpc_metadata_array* request_metadata,
                                                    grpc_byte_buffer** optional_payload,
                                                    grpc_completion_queue* cq_bound_to_call,
                                                    grpc_completion_queue* cq_for_notification,
                                                    void* tag_new) {
  static const auto real =
      RealC<decltype(&grpc_server_request_registered_call)>("grpc_server_request_registered_call");
  if (tag_new != nullptr) __tsan_release(tag_new);
  return real(server, registered_method, call, deadline, request_metadata, optional_payload,
              cq_bound_to_call, cq_for_notification, tag_new);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                      void* reserved) {
  static const auto real =
      RealC<decltype(&grpc_completion_queue_next)>("grpc_completion_queue_next");
  return Handed(real(cq, deadline, reserved));
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag, gpr_timespec deadline,
                                       void* reserved) {
  static const auto real =
      RealC<decltype(&grpc_completion_queue_pluck)>("grpc_completion_queue_pluck");
  return Handed(real(cq, tag, deadline, reserved));
}

}  // extern "C"

namespace absl {
ABSL_NAMESPACE_BEGIN

// ~Mutex is left alone: TSan counts __tsan_mutex_destroy as a write, and
// gRPC destroys its mutexes on whichever thread drops the last reference,
// ordered by atomics TSan cannot see. Freeing the memory resets TSan's state
// for it anyway.

void Mutex::Lock() {
  ATTN_REAL(void (*)(Mutex*), "5Mutex4LockEv");
  Locking(annotate, this, 0, ATTN_VOID(real(this)));
}

void Mutex::ReaderLock() {
  ATTN_REAL(void (*)(Mutex*), "5Mutex10ReaderLockEv");
  Locking(annotate, this, kRead, ATTN_VOID(real(this)));
}

bool Mutex::TryLock() {
  ATTN_REAL(bool (*)(Mutex*), "5Mutex7TryLockEv");
  return Locking(annotate, this, kTry, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  ATTN_REAL(bool (*)(Mutex*), "5Mutex13ReaderTryLockEv");
  return Locking(annotate, this, kRead | kTry, [&] { return real(this); });
}

void Mutex::Unlock() {
  ATTN_REAL(void (*)(Mutex*), "5Mutex6UnlockEv");
  Unlocking(annotate, this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  ATTN_REAL(void (*)(Mutex*), "5Mutex12ReaderUnlockEv");
  Unlocking(annotate, this, kRead, [&] { real(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  ATTN_REAL(void (*)(Mutex*, const Condition&), "5Mutex8LockWhenERKNS0_9ConditionE");
  Locking(annotate, this, 0, ATTN_VOID(real(this, cond)));
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  ATTN_REAL(void (*)(Mutex*, const Condition&), "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Locking(annotate, this, kRead, ATTN_VOID(real(this, cond)));
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Duration),
            "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Locking(annotate, this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Time),
            "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locking(annotate, this, 0, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Duration),
            "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Locking(annotate, this, kRead, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Time),
            "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locking(annotate, this, kRead, [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  ATTN_REAL(void (*)(Mutex*, const Condition&), "5Mutex5AwaitERKNS0_9ConditionE");
  Reacquiring(annotate, this, ATTN_VOID(real(this, cond)));
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Duration),
            "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Reacquiring(annotate, this, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  ATTN_REAL(bool (*)(Mutex*, const Condition&, absl::Time),
            "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Reacquiring(annotate, this, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  ATTN_REAL(void (*)(CondVar*, Mutex*), "7CondVar4WaitEPNS0_5MutexE");
  Reacquiring(annotate, mu, ATTN_VOID(real(this, mu)));
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  ATTN_REAL(bool (*)(CondVar*, Mutex*, absl::Duration),
            "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return Reacquiring(annotate, mu, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  ATTN_REAL(bool (*)(CondVar*, Mutex*, absl::Time),
            "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Reacquiring(annotate, mu, [&] { return real(this, mu, deadline); });
}

// Notification's inline HasBeenNotified is not covered: nothing here reads
// data after it.
void Notification::Notify() {
  ATTN_REAL(void (*)(Notification*), "12Notification6NotifyEv");
  Signalling(annotate, this, ATTN_VOID(real(this)));
}

void Notification::WaitForNotification() const {
  ATTN_REAL_CONST(void (*)(const Notification*), "12Notification19WaitForNotificationEv");
  Waiting(annotate, this, ATTN_VOID(real(this)));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  ATTN_REAL_CONST(bool (*)(const Notification*, absl::Duration),
                  "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  return Waiting(annotate, this, [&] { return real(this, timeout); });
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  ATTN_REAL_CONST(bool (*)(const Notification*, absl::Time),
                  "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  return Waiting(annotate, this, [&] { return real(this, deadline); });
}

bool BlockingCounter::DecrementCount() {
  ATTN_REAL(bool (*)(BlockingCounter*), "15BlockingCounter14DecrementCountEv");
  return Signalling(annotate, this, [&] { return real(this); });
}

void BlockingCounter::Wait() {
  ATTN_REAL(void (*)(BlockingCounter*), "15BlockingCounter4WaitEv");
  Waiting(annotate, this, ATTN_VOID(real(this)));
}

ABSL_NAMESPACE_END
}  // namespace absl
