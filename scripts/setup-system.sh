#!/usr/bin/env bash
# Debian packages the test suite needs, checked on every `make setup` (no stamp: a fresh venv
# stamp must not hide a package that went missing since). Missing ones are installed when
# that is possible (root, or password-less sudo, and apt-get); otherwise this prints which
# package to install and carries on, and the tests that need it fail with a setup error.
#
#   redis-server  shared conversation state tests (tests/component/test_router_replicas.py)
#   prometheus    the dashboard test (tests/component/test_monitoring_prometheus.py) and
#                 `kvrelay up --monitoring`
set -euo pipefail

# "debian-package:binary" pairs; the binary is what the tests look up on PATH or /usr/bin.
REQUIRED=(
  "redis-server:redis-server"
  "prometheus:prometheus"
)

missing=()
for entry in "${REQUIRED[@]}"; do
  package=${entry%%:*}
  binary=${entry#*:}
  if ! command -v "$binary" >/dev/null 2>&1 && [ ! -x "/usr/bin/$binary" ] \
      && [ ! -x "/usr/sbin/$binary" ]; then
    missing+=("$package")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    as_root=(sudo -n)
  else
    as_root=(unavailable)
  fi
fi
if [ "${as_root[0]:-}" = unavailable ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "kvrelay setup: missing Debian package(s): ${missing[*]}" >&2
  echo "kvrelay setup: cannot install them here (needs root and apt-get); install them with:" >&2
  echo "    sudo apt-get install -y ${missing[*]}" >&2
  echo "kvrelay setup: until then the tests that need them fail with a setup error" >&2
  exit 0
fi

echo "kvrelay setup: installing Debian package(s): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt_log=$(mktemp)
trap 'rm -f "$apt_log"' EXIT
if ! { "${as_root[@]}" apt-get update -qq \
       && "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
       >"$apt_log" 2>&1; then
  echo "kvrelay setup: apt-get could not install ${missing[*]}; last lines of its output:" >&2
  tail -n 15 "$apt_log" >&2
  echo "kvrelay setup: the tests that need ${missing[*]} will fail with a setup error" >&2
  exit 0
fi
echo "kvrelay setup: installed ${missing[*]}"
