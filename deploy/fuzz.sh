#!/usr/bin/env bash
# Usage: deploy/fuzz.sh [SECONDS]   (default 60)
#
# Builds the libFuzzer targets of tests/fuzz with Clang, ASan and UBSan into
# build-fuzz/ (ATTENTION_FUZZ_BUILD_DIR to choose) and runs each for SECONDS
# on its seed corpus, all three at once. Fails on any crash, leak, timeout
# (-timeout=10 s per input), memory blow-up (-rss_limit_mb=2048) or
# sanitizer report; the input that did it is left in <build>/fuzz-artifacts/
# (reproduce with `<build>/fuzz_request <file>`): fix the bug and add that
# input to the normal test suite as a regression test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${1:-60}
build=${ATTENTION_FUZZ_BUILD_DIR:-build-fuzz}
targets=(fuzz_request fuzz_safetensors fuzz_model_config)

bash deploy/install-deps.sh --fuzz
# -O1 -g1: as deploy/sanitize.sh, for build time.
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DATTENTION_FUZZ=ON \
  -DATTENTION_SANITIZE=address -DATTENTION_BUILD_BENCHMARKS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"
cmake --build "$build" -j2 --target "${targets[@]}"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp
export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-$(command -v llvm-symbolizer-14 || true)}

# New inputs go to <build>/fuzz-corpus; the committed ones are only read.
mkdir -p "$build/fuzz-artifacts"
pids=()
for t in "${targets[@]}"; do
  mkdir -p "$build/fuzz-corpus/$t"
  # The seeds, the inputs of past bugs, and the target's dictionary if any.
  inputs=("tests/fuzz/corpus/$t")
  [[ -d tests/fuzz/regressions/$t ]] && inputs+=("tests/fuzz/regressions/$t")
  dict=()
  [[ -f tests/fuzz/$t.dict ]] && dict=(-dict="tests/fuzz/$t.dict")
  "$build/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -detect_leaks=1 \
    -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$t-" "${dict[@]}" \
    "$build/fuzz-corpus/$t" "${inputs[@]}" > "$build/fuzz-$t.log" 2>&1 &
  pids+=($!)
done

status=0
for i in "${!targets[@]}"; do
  t=${targets[$i]}
  rc=0
  wait "${pids[$i]}" || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/fuzz-$t.log")
  if [[ $rc -eq 0 ]]; then
    echo "fuzz: $t: ok, ${execs:-?} inputs in ${seconds} s"
  else
    status=1
    echo "fuzz: $t: FAILED (exit $rc); log $build/fuzz-$t.log, inputs $build/fuzz-artifacts/" >&2
    grep -E -m 20 "ERROR|SUMMARY|FUZZ_CHECK|fuzz_[a-z_]*:|Test unit written" "$build/fuzz-$t.log" >&2 || true
  fi
done
exit "$status"
