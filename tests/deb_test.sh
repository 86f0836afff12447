#!/usr/bin/env bash
# The Debian packages (cpack -G DEB from a build; docs/install.md):
#   - attention-server holds the binaries, the demo model, the systemd unit
#     and /etc/default/attention-server (a conffile), with maintainer scripts,
#     and depends on Debian 12's runtime libraries as dpkg-shlibdeps computed;
#   - libattention-client-dev holds the library, headers, CMake package,
#     pkg-config file and .proto files;
#   - lintian reports no errors (its warnings are printed);
#   - systemd-analyze verify passes on the unit (run on a copy whose ExecStart
#     names the extracted binary), and the unit drains: TimeoutStopSec exceeds
#     the default --drain_seconds;
#   - the packaged server, started as the unit would start it, serves the
#     packaged demo model.
#
# Usage: deb_test.sh BUILD_DIR CLI_BIN
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 BUILD_DIR CLI_BIN" >&2
  exit 2
fi
build=$1 cli_bin=$2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/deploy/server_control.sh"
tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: deb_test: $*" >&2; exit 1; }
for tool in cpack dpkg-deb dpkg-shlibdeps lintian systemd-analyze; do
  command -v "$tool" >/dev/null || fail "needs $tool (deploy/install-deps.sh)"
done

(cd "$build" && cpack -G DEB -B "$tmp/packages" >"$tmp/cpack.log" 2>&1) ||
  { cat "$tmp/cpack.log" >&2; fail "cpack -G DEB failed"; }
server_deb=$(ls "$tmp"/packages/attention-server_*_amd64.deb)
client_deb=$(ls "$tmp"/packages/libattention-client-dev_*_amd64.deb)

# Contents.
dpkg-deb -x "$server_deb" "$tmp/server"
for f in usr/bin/attention_server usr/bin/attention_cli usr/bin/attention_loadtest \
  usr/share/attention-server/models/demo/config.pbtxt \
  usr/share/attention-server/models/demo/weights.safetensors \
  lib/systemd/system/attention-server.service etc/default/attention-server \
  usr/share/doc/attention-server/copyright usr/share/doc/attention-server/changelog.gz; do
  [[ -e $tmp/server/$f ]] || fail "attention-server lacks /$f"
done
dpkg-deb -e "$server_deb" "$tmp/server-control"
grep -qx /etc/default/attention-server "$tmp/server-control/conffiles" ||
  fail "/etc/default/attention-server is not a conffile"
for script in postinst prerm postrm; do
  [[ -x $tmp/server-control/$script ]] || fail "attention-server has no $script"
done
grep -q "adduser --system" "$tmp/server-control/postinst" || fail "postinst does not add the system user"
depends=$(dpkg-deb -f "$server_deb" Depends)
for lib in libgrpc++1.51 libprotobuf32 libdnnl2 libabsl20220623 libgomp1 adduser; do
  [[ $depends == *"$lib"* ]] || fail "attention-server's Depends lacks $lib: $depends"
done
echo "deb_test: attention-server Depends: $depends"
dpkg-deb -x "$client_deb" "$tmp/client"
for f in usr/include/client/attention_client.h usr/include/attention/v1/service.grpc.pb.h \
  usr/lib/libattention_client.a usr/lib/cmake/AttentionClient/AttentionClientConfig.cmake \
  usr/lib/pkgconfig/attention-client.pc usr/share/attention/proto/attention/v1/service.proto; do
  [[ -e $tmp/client/$f ]] || fail "libattention-client-dev lacks /$f"
done

# lintian: no errors; warnings listed.
lintian --fail-on error "$server_deb" "$client_deb" >"$tmp/lintian.log" 2>&1 ||
  { cat "$tmp/lintian.log" >&2; fail "lintian reports errors"; }
grep -E '^[EW]: ' "$tmp/lintian.log" | sed 's/^/deb_test: lintian: /' || true

# The unit: systemd-analyze verify says nothing, and the stop timeout leaves
# the drain its time.
unit="$tmp/server/lib/systemd/system/attention-server.service"
sed "s|/usr/bin/attention_server|$tmp/server/usr/bin/attention_server|" "$unit" \
  >"$tmp/attention-server.service"
systemd-analyze verify "$tmp/attention-server.service" >"$tmp/verify.log" 2>&1 ||
  { cat "$tmp/verify.log" >&2; fail "systemd-analyze verify failed"; }
[[ ! -s $tmp/verify.log ]] || { cat "$tmp/verify.log" >&2; fail "systemd-analyze verify complains"; }
for line in "User=attention-server" "Restart=on-failure" "KillSignal=SIGTERM" \
  "EnvironmentFile=-/etc/default/attention-server" 'ExecStart=/usr/bin/attention_server $ATTENTION_SERVER_FLAGS'; do
  grep -qxF "$line" "$unit" || fail "the unit lacks $line"
done
source "$tmp/server/etc/default/attention-server"
stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$unit")
drain=$(sed -n 's/.*--drain_seconds=\([0-9]*\).*/\1/p' <<<"$ATTENTION_SERVER_FLAGS")
[[ -n $stop && -n $drain ]] && ((stop > drain + 1)) ||
  fail "TimeoutStopSec ($stop s) must exceed the default --drain_seconds ($drain) + the answers' linger"

# The packaged server with the packaged flags (its own port, metrics off, and
# the model from the extracted tree) serves the demo model.
flags=${ATTENTION_SERVER_FLAGS//\/usr\/share\/attention-server/$tmp/server/usr/share/attention-server}
flags=$(sed -e 's/--listen=[^ ]*//' -e 's/--metrics_port=[^ ]*//' <<<"$flags")
mkdir "$tmp/run"
# shellcheck disable=SC2086  # the flags are words, as systemd splits them
server_start "$tmp/server/usr/bin/attention_server" "$tmp/run" $flags
server_wait_serving "$cli_bin"
"$cli_bin" --target "127.0.0.1:$SERVER_PORT" models | grep -q '"demo"' ||
  fail "the packaged server does not serve the packaged demo model"
server_stop || fail "the packaged server did not exit 0 on SIGTERM"
echo "deb_test: PASS"
