#!/usr/bin/env bash
# Usage: deploy/sanitize.sh asan|tsan
#
#   asan: builds everything (benchmarks aside) with ASan and UBSan
#         (ATTENTION_SANITIZE=address) into build-asan8/ and runs the whole
#         test suite with ctest.
#   tsan: builds server_test, engine_test, client_test and loadtest_test
#         with TSan (ATTENTION_SANITIZE=thread) into build-tsan/ and runs every
#         server test (scheduler, streams, service, drain, hostile input, ...),
#         the engine's batching and concurrency tests, every client library
#         test (streams, session helpers, retries) and the load tester's
#         untimed tests, which also run the real server and load tester.
#
# Fails when a test fails and on any sanitizer report, including one from a
# process whose exit code a test does not look at (the smoke test's server, the
# load tester): every report is written to <build>/sanitizer-reports/, which
# must stay empty. ATTENTION_SANITIZE_BUILD_DIR chooses another build folder.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=${1:-}
case $mode in
  asan) build=${ATTENTION_SANITIZE_BUILD_DIR:-build-asan8} sanitize=address ;;
  tsan) build=${ATTENTION_SANITIZE_BUILD_DIR:-build-tsan} sanitize=thread ;;
  *)
    echo "usage: $0 asan|tsan" >&2
    exit 2
    ;;
esac

bash deploy/install-deps.sh
# -O1 -g1 (line tables: enough for the reports' stacks) compiles about 40%
# faster than the default -O2 -g, which matters in CI's time budget.
cmake -S . -B "$build" -G Ninja -DATTENTION_SANITIZE=$sanitize -DATTENTION_BUILD_BENCHMARKS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"

reports=$PWD/$build/sanitizer-reports
rm -rf "$reports"
mkdir -p "$reports"
status=0
if [[ $mode == asan ]]; then
  cmake --build "$build" -j2
  export ASAN_OPTIONS=detect_leaks=1:log_path=$reports/asan
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan
  # print_suppressions=0: LSan would otherwise write its table of matched
  # suppressions, which is no report, into the reports folder.
  export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
  log=$build/sanitize-ctest.log
  # Not the tests labelled "packaging" (install rules, .deb, manifests and
  # rule files): they check what is shipped, not how our code runs.
  ctest --test-dir "$build" --output-on-failure -j2 -LE packaging 2>&1 | tee "$log" || status=$?
  # As deploy/test.sh: a skipped test is a failure (a failed SetUpTestSuite
  # shows as skipped tests).
  if grep -q "(Skipped)" "$log"; then
    echo "sanitize asan: tests were skipped" >&2
    status=1
  fi
else
  cmake --build "$build" -j2 --target server_test engine_test client_test loadtest_test
  # tests/tsan_absl_sync.cc sets the other options (halt_on_error, the
  # suppressions); OMP_THREAD_LIMIT=1: see CMakeLists.txt.
  export TSAN_OPTIONS=log_path=$reports/tsan
  export OMP_THREAD_LIMIT=1
  # Each binary in one process: a server suite's tests share its server, and
  # ctest's process per test would start hundreds of servers under TSan.
  # Not the 32768-position call, nor the 45-GFLOP additive one: single-threaded
  # and instrumented they compute for minutes, and their threads are the ones
  # every other server test runs.
  "$build/server_test" --gtest_brief=1 \
    --gtest_filter='-LongSequenceTest.ThirtyTwoThousandKeysWithoutWeightsAreAnsweredByDefault:FairShareTest.*' \
    || status=$?
  "$build/engine_test" --gtest_brief=1 \
    --gtest_filter='*BatchTest.*:EngineConcurrencyTest.*' || status=$?
  "$build/client_test" --gtest_brief=1 || status=$?
  # Not the load generator's timed tests (the ALONE ones of loadtest_test,
  # which CMake writes to loadtest_test.alone): instrumented, they would time
  # TSan.
  alone=$(< "$build/loadtest_test.alone")
  "$build/loadtest_test" --gtest_brief=1 --gtest_filter="-$alone" || status=$?
fi

found=$(grep -l -E "ERROR: [A-Za-z]+Sanitizer|runtime error:|WARNING: ThreadSanitizer" \
  "$reports"/* 2> /dev/null || true)
if [[ -n $found ]]; then
  echo "sanitize $mode: sanitizer reports:" >&2
  for f in $found; do
    echo "--- $f" >&2
    cat "$f" >&2
  done
  status=1
fi
if [[ $status -eq 0 ]]; then
  echo "sanitize $mode: passed, no sanitizer reports"
else
  echo "sanitize $mode: FAILED" >&2
fi
exit "$status"
