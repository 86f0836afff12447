#!/usr/bin/env bash
# Installs the Debian 12 packages that building and testing need (with
# --fuzz, also what deploy/fuzz.sh needs; with --build-only, only what
# building needs; with --python-client [--without-torch], only what
# deploy/install-python-client.sh needs), only those missing; runs apt-get
# update only when a missing package has no candidate or the install fails on
# stale lists. Idempotent; installing needs root.
set -euo pipefail

# ocl-icd-opencl-dev: only recommended by libdnnl-dev, but its CMake config
# (find_package(dnnl)) fails without OpenCL's library and headers.
packages=(
  cmake ninja-build g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libdnnl-dev ocl-icd-opencl-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcpp-httplib-dev libspdlog-dev libssl-dev openssl jq
  libnghttp2-dev
)
# Debian's Python with grpcio, protobuf and numpy, and pip, setuptools and
# venv to install the Python client (client/python, python_client_test,
# deploy/install-python-client.sh; torch, for attention_client.torch, apart).
python_packages=(
  python3 python3-grpcio python3-protobuf python3-numpy python3-pip python3-setuptools
  python3-venv
)
# What the tests run beyond our binaries (not with --build-only, which the
# image's build stage uses): haproxy, the proxy session_proxy_test routes
# sessions through; prometheus (with promtool): prometheus_test and
# prometheus_rules; dpkg-dev (dpkg-shlibdeps), lintian and systemd
# (systemd-analyze): deb_package; the Python client's packages and torch;
# chromium: the load tester's HTML report tests open their pages in it.
test_packages=(
  haproxy prometheus dpkg-dev lintian systemd "${python_packages[@]}" python3-torch chromium
)
# --fuzz (deploy/fuzz.sh): Clang with libFuzzer and its sanitizer runtimes,
# llvm-symbolizer for readable reports, and libomp-14-dev for Clang's omp.h
# only (the fuzz build links GCC's libgomp, as oneDNN does).
# --python-client: the Python client's packages (torch unless
# --without-torch follows), and protoc with grpc_python_plugin for its stubs.
case ${1:-} in
  "") packages+=("${test_packages[@]}") ;;
  --build-only) ;;
  --fuzz) packages+=("${test_packages[@]}" clang libclang-rt-14-dev llvm-14 libomp-14-dev) ;;
  --python-client)
    packages=("${python_packages[@]}" protobuf-compiler protobuf-compiler-grpc)
    case ${2:-} in
      "") packages+=(python3-torch) ;;
      --without-torch) ;;
      *) echo "install-deps: --python-client takes only --without-torch, not $2" >&2; exit 2 ;;
    esac
    ;;
  *)
    echo "install-deps: unknown option $1 (--build-only, --fuzz, --python-client [--without-torch])" >&2
    exit 2
    ;;
esac

installed() {
  [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) == ii* ]]
}

has_candidate() {
  local candidate
  candidate=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p')
  [[ -n $candidate && $candidate != "(none)" ]]
}

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages are installed"
  exit 0
fi

echo "install-deps: missing: ${missing[*]}"
if [[ $EUID -ne 0 ]]; then
  echo "install-deps: run as root to install them (apt-get install ${missing[*]})" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
updated=0
for p in "${missing[@]}"; do
  if ! has_candidate "$p"; then
    apt-get update
    updated=1
    break
  fi
done
install() { apt-get install -y --no-install-recommends "${missing[@]}"; }
if ! install; then
  [[ $updated -eq 0 ]] || exit 1
  apt-get update
  install
fi
echo "install-deps: installed ${missing[*]}"
