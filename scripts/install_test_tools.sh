#!/usr/bin/env bash
# Best effort: command-line validators some deploy/ tests use when present (they skip without them).
#   promtool (Debian package `prometheus`): `promtool check config|rules` and `promtool test rules`.
#   kubectl: `kubectl kustomize` renders the overlays (not packaged by Debian; many images ship it).
# Needs root and apt-get; does nothing elsewhere, and never fails the build.
set -uo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
    >/dev/null 2>&1 || echo "install_test_tools: could not install promtool; its tests will skip" >&2
  # The package starts no service in a container; stop one if an init system did.
  (command -v systemctl >/dev/null 2>&1 && systemctl stop prometheus) >/dev/null 2>&1 || true
fi
exit 0
