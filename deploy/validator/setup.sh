# Sourced by deploy/k8s/validate.sh and deploy/validate-compose.sh (bash, set
# -euo pipefail): validator_setup installs Node.js if it is missing and the
# packages of deploy/validator/package-lock.json into deploy/validator/node_modules
# (npm ci; skipped while the installed lock file is unchanged).
validator_setup() {
  local dir
  dir="$(dirname "${BASH_SOURCE[0]}")"
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "validator: installing nodejs and npm"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm >/dev/null ||
      { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm >/dev/null; }
  fi
  if ! cmp -s "$dir/package-lock.json" "$dir/node_modules/.installed-lock.json"; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    cp "$dir/package-lock.json" "$dir/node_modules/.installed-lock.json"
  fi
}
