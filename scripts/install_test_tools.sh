#!/usr/bin/env bash
# Best effort: system tools some tests use when present (they skip without them).
#   promtool (Debian package `prometheus`): `promtool check config|rules` and `promtool test rules`.
#   bwrap (Debian package `bubblewrap`): the sandbox of the `code` reward (grpo/rewards/sandbox.py, docs/sandbox.md).
#   kubectl: `kubectl kustomize` renders the overlays (not packaged by Debian; many images ship it).
# Needs root and apt-get; does nothing elsewhere, and never fails the build.
set -uo pipefail
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} = 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq >/dev/null 2>&1
  for package in "${missing[@]}"; do
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1 \
      || echo "install_test_tools: could not install $package; its tests will skip" >&2
  done
  # The prometheus package starts no service in a container; stop one if an init system did.
  (command -v systemctl >/dev/null 2>&1 && systemctl stop prometheus) >/dev/null 2>&1 || true
fi
exit 0
