#!/usr/bin/env bash
# Builds the image from Dockerfile and tests it, without a Docker engine:
#
#   1. installs podman, buildah and debootstrap if missing; validates
#      deploy/compose.yaml (deploy/validate-compose.sh; deploy/k8s/validate.sh is
#      in the test command, as ctest k8s_manifests);
#   2. builds attention_cli and attention_loadtest for the host (in build/, or
#      $ATTENTION_BUILD_DIR);
#   3. makes a Debian 12 base image: debootstrap --variant=minbase bookworm, then
#      podman import; the tarball is cached in $ATTENTION_CACHE_DIR (default
#      ~/.cache/attention-service) and remade after 30 days;
#   4. podman build --isolation chroot --network host --build-arg BASE_IMAGE=...;
#      checks the image's user, ports, entrypoint and HEALTHCHECK, and that its
#      binaries find all their libraries;
#   5. runs the image's entrypoint with buildah run --isolation chroot --network
#      host (deploy/container_server.sh) on a free port of 127.0.0.1, and from
#      the host: tests/smoke_test.sh (health, models, the demo model, a golden
#      case, SIGTERM exit 0); then again for the HEALTHCHECK's command run in
#      the image, the metrics endpoint and a short attention_loadtest, and
#      SIGTERM, exit 0;
#   6. removes its containers; the image ($ATTENTION_IMAGE, default
#      localhost/attention-service:test) and the build's layers stay, so that
#      the next run rebuilds only what changed (podman image prune frees them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source deploy/server_control.sh

start=$SECONDS
step() { echo "=== container-test: $* ($((SECONDS - start)) s)"; }
fail() { server_fail "container-test: $*"; }

build_dir=${ATTENTION_BUILD_DIR:-build}
image=${ATTENTION_IMAGE:-localhost/attention-service:test}
base_image=localhost/attention-debian-base:bookworm
cache_dir=${ATTENTION_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/attention-service}
base_tar=$cache_dir/debian-bookworm-minbase.tar

# --- 1. tools, and the manifests (fast, so first) ------------------------------
step "tools"
missing=()
for tool in podman buildah debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "container-test: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" ||
    { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
fi
bash deploy/validate-compose.sh

# --- 2. host binaries -------------------------------------------------------------
step "host binaries in $build_dir"
bash deploy/install-deps.sh
if [[ -f $build_dir/CMakeCache.txt ]]; then
  cmake -S . -B "$build_dir" >/dev/null
else
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
grep -q '/attention_loadtest\.dir$' "$build_dir/CMakeFiles/TargetDirectories.txt" ||
  fail "CMake has no target attention_loadtest (client/loadtest): the load test step needs it"
cmake --build "$build_dir" -j2 --target attention_cli attention_loadtest
cli=$build_dir/attention_cli
loadtest=$build_dir/attention_loadtest

# --- 3. the Debian 12 base image --------------------------------------------------
step "base image $base_image"
# Debootstrap from the host's own Debian mirror; its default otherwise.
host_mirror() {
  { sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | tr ' ' '\n'
    sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\)[[:space:]]\+bookworm[[:space:]].*/\2/p' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null
  } | grep -E '^https?://' | grep -v -- '-security' | head -n 1 || true
}
if [[ -s $base_tar ]] && [[ -n $(find "$base_tar" -mtime +30) ]]; then
  echo "container-test: $base_tar is over 30 days old; making a new one"
  rm -f "$base_tar"
  podman rmi --force "$base_image" >/dev/null 2>&1 || true
fi
if [[ ! -s $base_tar ]]; then
  mkdir -p "$cache_dir"
  rootfs=$(mktemp -d)
  mirror=${ATTENTION_DEBIAN_MIRROR:-$(host_mirror)}
  echo "container-test: debootstrap --variant=minbase bookworm ${mirror:-"(the default mirror)"}"
  debootstrap --variant=minbase bookworm "$rootfs" ${mirror:+"$mirror"} >"$cache_dir/debootstrap.log" 2>&1 ||
    { tail -n 20 "$cache_dir/debootstrap.log" >&2; rm -rf "$rootfs"; fail "debootstrap failed"; }
  # As in Debian's slim images: no package cache or lists.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar --numeric-owner -C "$rootfs" -cf "$base_tar.tmp" .
  mv "$base_tar.tmp" "$base_tar"
  rm -rf "$rootfs"
  podman rmi --force "$base_image" >/dev/null 2>&1 || true
fi
podman image exists "$base_image" || podman import "$base_tar" "$base_image"

# --- 4. the image -------------------------------------------------------------------
step "podman build $image"
export ATTENTION_IMAGE=$image
export ATTENTION_TEST_RUN=attention-container-test-$$
tmp=$(mktemp -d)
# Also after deploy/container_server.sh was killed: its server, found by the
# ATTENTION_CONTAINER_RUN in its environment (then buildah run ends by itself),
# and every working container named after this run.
cleanup() {
  server_kill
  local environ pid name killed=""
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    if { tr '\0' '\n' <"$environ"; } 2>/dev/null |
      grep -qx "ATTENTION_CONTAINER_RUN=$ATTENTION_TEST_RUN"; then
      kill -KILL "$pid" 2>/dev/null && killed=1
    fi
  done
  [[ -z $killed ]] || sleep 1
  for name in $(buildah containers --format '{{.ContainerName}}' 2>/dev/null); do
    [[ $name != "$ATTENTION_TEST_RUN"-* ]] || buildah rm "$name" >/dev/null 2>&1 || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT

# --format docker: the OCI format has no HEALTHCHECK.
podman build --isolation chroot --network host --format docker \
  --build-arg BASE_IMAGE="$base_image" --tag "$image" --file Dockerfile .
config=$(podman image inspect --format '{{json .Config}}' "$image")
healthcheck=$(podman image inspect --format '{{json .HealthCheck}}' "$image")
echo "image: $(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec) $config"
echo "healthcheck: $healthcheck"
user=$(podman image inspect --format '{{.Config.User}}' "$image")
[[ ${user%%:*} =~ ^[0-9]+$ && ${user%%:*} -ne 0 ]] || fail "the image's USER is '$user', not a numeric non-root user"
[[ $config == *'"50051/tcp"'* && $config == *'"9464/tcp"'* ]] || fail "the image does not EXPOSE 50051 and 9464"
[[ $config == *'"Entrypoint":["attention_server",'* ]] || fail "the image's entrypoint is not attention_server"
[[ $healthcheck == *'"attention_cli",'*'"health"'* ]] || fail "the image's HEALTHCHECK does not run attention_cli health"
# A second container of the image, for commands other than the server.
check_ctr=$(buildah from --name "$ATTENTION_TEST_RUN-check" "$image")
in_image() { buildah run --isolation chroot --network host "$check_ctr" -- "$@"; }
in_image sh -c 'for b in attention_server attention_cli attention_loadtest; do
                  test -x "/usr/local/bin/$b" || { echo "no /usr/local/bin/$b"; exit 1; }; done
                ! ldd /usr/local/bin/* | grep "not found"' ||
  fail "the image lacks a binary or a runtime library (above)"
echo "binaries and their libraries in the image: ok"

# --- 5. run it ----------------------------------------------------------------------
step "smoke test of the image"
bash tests/smoke_test.sh deploy/container_server.sh "$cli" tests/golden

step "health check, metrics and load test of the image"
server_start deploy/container_server.sh "$tmp" --drain_seconds=5
server_wait_serving "$cli"
echo "SERVING on 127.0.0.1:$SERVER_PORT (from the image)"

# The HEALTHCHECK's own command, with this run's port in place of 50051.
mapfile -t check < <(podman image inspect \
  --format '{{range .HealthCheck.Test}}{{println .}}{{end}}' "$image" | grep -v '^$' | tail -n +2 |
  sed "s/127\.0\.0\.1:50051/127.0.0.1:$SERVER_PORT/")
in_image "${check[@]}" || fail "the HEALTHCHECK command (${check[*]}) failed in the image"
echo "HEALTHCHECK command in the image: ok"

metrics_port=$(sed -n 's|.*metrics on http://127\.0\.0\.1:\([0-9]*\)/metrics.*|\1|p' "$SERVER_LOG" | head -n 1)
[[ -n $metrics_port ]] || fail "the server logged no metrics address"

"$loadtest" --target "127.0.0.1:$SERVER_PORT" --model demo --duration 3s --concurrency 4 \
  --threshold 'errors<1%' || fail "attention_loadtest against the image failed"

curl -fsS "http://127.0.0.1:$metrics_port/metrics" >"$tmp/metrics.txt" ||
  fail "GET /metrics on port $metrics_port failed"
grep -q '^attention_requests_total{method="Attend",model="demo",code="OK"} [1-9]' "$tmp/metrics.txt" ||
  fail "/metrics counts no successful demo calls: $(grep attention_requests_total "$tmp/metrics.txt")"
echo "metrics: $(grep '^attention_requests_total{method="Attend",model="demo",code="OK"}' "$tmp/metrics.txt")"

status=0
server_stop || status=$?
[[ $status -eq 0 ]] || fail "the server in the image exited with $status after SIGTERM"
echo "SIGTERM: the server in the image exited 0"
step "PASS"
