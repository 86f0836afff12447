#!/usr/bin/env bash
# End-to-end check of the two binaries: starts attention_server on 127.0.0.1:0,
# drives it with attention_cli (health, info, models, the built-in demo model, a
# hand-checked call and the golden case sdpa_basic) and checks its reflection
# (tests/reflection_check.py), sends SIGHUP and expects it to serve on, then stops
# it with SIGTERM and expects exit code 0.
#
# Usage: smoke_test.sh SERVER_BIN CLI_BIN GOLDEN_DIR
set -euo pipefail

if [[ $# -ne 3 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN GOLDEN_DIR" >&2
  exit 2
fi
server_bin=$1
cli_bin=$2
golden_dir=$3

source "$(dirname "${BASH_SOURCE[0]}")/../deploy/server_control.sh"

tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT
fail() { server_fail "smoke_test: $*"; }

# The numbers of `"FIELD":{"shape":[...],"float_data":[...]}` in the JSON on
# stdin, as "SHAPE|VALUES" with commas and no quotes or spaces.
tensor_of() {
  tr -d ' \n' | sed -n "s/.*\"$1\":{\"shape\":\[\([^]]*\)\],\"float_data\":\[\([^]]*\)\]}.*/\1|\2/p" |
    tr -d '"'
}

# all_close GOT WANT ATOL RTOL: two comma-separated lists of equal length with
# |got - want| <= atol + rtol * |want| element-wise.
all_close() {
  awk -v got="$1" -v want="$2" -v atol="$3" -v rtol="$4" 'BEGIN {
    n = split(got, g, ","); m = split(want, w, ",")
    if (n != m) { printf "%d values, want %d\n", n, m; exit 1 }
    for (i = 1; i <= n; i++) {
      d = g[i] - w[i]; if (d < 0) d = -d
      a = w[i]; if (a < 0) a = -a
      if (d > atol + rtol * a) { printf "element %d: got %s, want %s\n", i - 1, g[i], w[i]; exit 1 }
    }
  }'
}

# --- start, and health SERVING once warm-up is done ------------------------------
server_start "$server_bin" "$tmp"
server_wait_serving "$cli_bin"
echo "health: SERVING"
cli=("$cli_bin" --target "127.0.0.1:$SERVER_PORT" --timeout 10s)

# --- info and models -------------------------------------------------------
"${cli[@]}" info >"$tmp/info.json" || fail "info failed"
grep -q '"version"' "$tmp/info.json" || fail "info has no version: $(cat "$tmp/info.json")"
"${cli[@]}" models >"$tmp/models.json" || fail "models failed"
grep -q '"name": "demo"' "$tmp/models.json" ||
  fail "the built-in demo model is not served by default: $(cat "$tmp/models.json")"
echo "info and models (demo served by default): ok"

# --- reflection describes every service it lists (what grpcurl needs) -------------
/usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/reflection_check.py" "127.0.0.1:$SERVER_PORT" \
  >"$tmp/reflection.out" 2>&1 || fail "reflection: $(cat "$tmp/reflection.out")"
tail -n 1 "$tmp/reflection.out"

# --- the built-in demo model ------------------------------------------------------
repo_root="$(dirname "${BASH_SOURCE[0]}")/.."
"${cli[@]}" call "$repo_root/deploy/demo_request.json" >"$tmp/demo.json" 2>"$tmp/call.err" ||
  fail "demo call: $(cat "$tmp/call.err")"
demo_output=$(tensor_of output <"$tmp/demo.json")
demo_weights=$(tensor_of weights <"$tmp/demo.json")
[[ ${demo_output%%|*} == 1,3,64 ]] || fail "demo output shape [${demo_output%%|*}], want [1,3,64]"
[[ ${demo_weights%%|*} == 1,3,3 ]] || fail "demo weights shape [${demo_weights%%|*}], want [1,3,3]"
# Causal: the first query row attends only to key 0.
[[ ${demo_weights#*|} == 1,0,0,* ]] || fail "demo weights row 0 is not [1, 0, 0]: ${demo_weights#*|}"
echo "demo model: output [1,3,64], causal weights [1,3,3]"

# --- a call checked by hand ----------------------------------------------------
# Self-attention of q0 = [2,0,0,0], q1 = [0,2,0,0] with scale 1/sqrt(4): the
# scores are [[2, 0], [0, 2]], so each row's weights are softmax([2, 0]) =
# [0.8807971, 0.1192029] and the output is those weights times the rows.
cat >"$tmp/request.json" <<'EOF'
{
  "id": "smoke",
  "query": {"shape": [1, 2, 4], "float_data": [2, 0, 0, 0, 0, 2, 0, 0]},
  "need_weights": true
}
EOF
"${cli[@]}" call "$tmp/request.json" >"$tmp/response.json" 2>"$tmp/call.err" ||
  fail "call: $(cat "$tmp/call.err")"
grep -q '"id": "smoke"' "$tmp/response.json" || fail "the response does not echo the id"
output=$(tensor_of output <"$tmp/response.json")
weights=$(tensor_of weights <"$tmp/response.json")
[[ ${output%%|*} == 1,2,4 ]] || fail "output shape [${output%%|*}], want [1,2,4]"
[[ ${weights%%|*} == 1,1,2,2 ]] || fail "weights shape [${weights%%|*}], want [1,1,2,2]"
why=$(all_close "${output#*|}" 1.7615942,0.2384058,0,0,0.2384058,1.7615942,0,0 1e-5 1e-4) ||
  fail "output: $why"
why=$(all_close "${weights#*|}" 0.8807971,0.1192029,0.1192029,0.8807971 1e-6 1e-4) ||
  fail "weights: $why"
echo "call: output [1,2,4] and weights [1,1,2,2] as expected"

# --- a golden case through both binaries ---------------------------------------
# tests/golden/sdpa_basic.json is compact JSON whose tensors hold no nested
# objects; its f32 tensors become float_data tensors of an AttendRequest.
golden="$golden_dir/sdpa_basic.json"
[[ -f $golden ]] || fail "no golden case $golden"
golden_tensor() {
  grep -o "\"$1\":{[^}]*}" "$golden" | head -n 1 |
    sed 's/"dtype":"f32",//; s/"data":/"float_data":/'
}
{
  printf '{"id":"golden",%s,%s,%s,"need_weights":true}\n' \
    "$(golden_tensor query)" "$(golden_tensor key)" "$(golden_tensor value)"
} >"$tmp/golden_request.json"
"${cli[@]}" call "$tmp/golden_request.json" >"$tmp/golden_response.json" 2>"$tmp/call.err" ||
  fail "golden call: $(cat "$tmp/call.err")"
atol=$(grep -o '"atol":[^,}]*' "$golden" | cut -d: -f2)
rtol=$(grep -o '"rtol":[^,}]*' "$golden" | cut -d: -f2)
for field in output weights; do
  got=$(tensor_of "$field" <"$tmp/golden_response.json")
  want=$(golden_tensor "$field" | tensor_of "$field")
  [[ ${got%%|*} == "${want%%|*}" ]] || fail "golden $field shape [${got%%|*}], want [${want%%|*}]"
  why=$(all_close "${got#*|}" "${want#*|}" "$atol" "$rtol") || fail "golden $field: $why"
done
echo "golden sdpa_basic: output and weights within atol $atol, rtol $rtol"

# --- SIGHUP: logged and ignored (nothing to reload), the server serves on ------------
kill -HUP "$SERVER_PID"
for _ in $(seq 50); do grep -q "(SIGHUP): ignored" "$SERVER_LOG" && break; sleep 0.1; done
grep -q "(SIGHUP): ignored" "$SERVER_LOG" || fail "no log line for SIGHUP"
kill -0 "$SERVER_PID" 2>/dev/null || fail "SIGHUP ended the server"
health=$("${cli[@]}" health) || fail "health after SIGHUP: $health"
echo "SIGHUP: logged and ignored, health $health"

# --- graceful stop ---------------------------------------------------------------
status=0
server_stop || status=$?
[[ $status -eq 0 ]] || fail "the server exited with $status after SIGTERM"
echo "SIGTERM: the server exited 0"
echo "smoke_test: PASS"
