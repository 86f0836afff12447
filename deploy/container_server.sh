#!/usr/bin/env bash
# attention_server from a container image, used as if it were the local binary
# (deploy/container-test.sh passes it to tests/smoke_test.sh as SERVER_BIN):
#
#   ATTENTION_IMAGE=IMAGE deploy/container_server.sh [SERVER FLAG...]
#
# Runs the image's entrypoint in a new buildah working container with
# `buildah run --isolation chroot --network host` (no Docker engine needed),
# appending --metrics_host=127.0.0.1 --metrics_port=0 and then the given flags
# (a repeated flag: the last one wins). A --port_file on the host is written
# through a bind mount, since the image's non-root user cannot write to the
# caller's folder. SIGTERM, SIGINT and SIGHUP go to the server itself (buildah
# run would kill it). Exits with the server's exit code and removes the container.
# For a caller to clean up after this script was killed: the server's
# environment holds ATTENTION_CONTAINER_RUN=$ATTENTION_TEST_RUN, and the
# container is named "$ATTENTION_TEST_RUN-PID".
set -euo pipefail

image=${ATTENTION_IMAGE:?set ATTENTION_IMAGE to the image to run}
run_id=${ATTENTION_TEST_RUN:-attention-server}
port_file=""
flags=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --port_file) port_file=$2; shift 2 ;;
    --port_file=*) port_file=${1#*=}; shift ;;
    *) flags+=("$1"); shift ;;
  esac
done

run_dir=$(mktemp -d)
chmod 0777 "$run_dir"
ctr=""
run_pid=""
cleanup() {
  if [[ -n $run_pid ]] && kill -0 "$run_pid" 2>/dev/null; then
    server_pid=$(find_server) && kill -KILL "$server_pid" 2>/dev/null
    wait "$run_pid" 2>/dev/null || true
  fi
  if [[ -n $ctr ]]; then buildah rm "$ctr" >/dev/null || true; fi
  rm -rf "$run_dir"
}
trap cleanup EXIT
# Passed on to the server once it runs (see the loop below).
pending=""
trap 'pending=TERM' TERM
trap 'pending=INT' INT
trap 'pending=HUP' HUP

# The attention_server process below buildah run (buildah-chroot-runtime, then
# buildah-chroot-exec, then the server; no PID namespace under chroot isolation).
find_server() {
  local queue=("$run_pid") pid
  while [[ ${#queue[@]} -gt 0 ]]; do
    pid=${queue[0]}
    queue=("${queue[@]:1}")
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == attention_serve* ]]; then
      echo "$pid"
      return 0
    fi
    mapfile -t -O "${#queue[@]}" queue < <(pgrep -P "$pid" || true)
  done
  return 1
}

ctr=$(buildah from --name "$run_id-$$" "$image")
mapfile -t entrypoint < <(buildah inspect --type container \
  --format '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}' "$ctr" | grep -v '^$')
if [[ ${#entrypoint[@]} -eq 0 ]]; then
  echo "container_server: $image has no entrypoint" >&2
  exit 1
fi
run_flags=(--metrics_host=127.0.0.1 --metrics_port=0 "${flags[@]}")
[[ -z $port_file ]] || run_flags+=(--port_file=/run/attention/port)

buildah run --isolation chroot --network host --env "ATTENTION_CONTAINER_RUN=$run_id" \
  --volume "$run_dir:/run/attention" "$ctr" -- "${entrypoint[@]}" "${run_flags[@]}" &
run_pid=$!
relayed=""
while kill -0 "$run_pid" 2>/dev/null; do
  if [[ -n $port_file && -z $relayed && -s $run_dir/port ]]; then
    cp "$run_dir/port" "$port_file.tmp" && mv "$port_file.tmp" "$port_file"
    relayed=1
  fi
  if [[ -n $pending ]] && server_pid=$(find_server); then
    kill -"$pending" "$server_pid"
    pending=""
  fi
  sleep 0.1
done
status=0
wait "$run_pid" || status=$?
run_pid=""
exit "$status"
