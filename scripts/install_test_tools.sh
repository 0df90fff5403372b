#!/usr/bin/env bash
# Best effort: system tools some tests use when present (they skip without them).
#   promtool and prometheus (Debian package `prometheus`): `promtool check config|rules`, `promtool test rules`, and a
#   real server that scrapes in-process jobs (tests/in_process/test_prometheus_real.py).
#   bwrap (Debian package `bubblewrap`): the sandbox of the `code` reward (sandbox/runner.py, docs/sandbox.md).
#   kubectl: `kubectl kustomize` renders the overlays (not packaged by Debian; many images ship it).
#   chromium (Debian package `chromium`, about 1 min): headless, opens the `grpo-cluster report` page
#   (tests/in_process/test_report_samples.py: no console errors, the curves on a screenshot, a sample opened).
# Needs root and apt-get; does nothing elsewhere, and never fails the build.
set -uo pipefail
missing=()
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing+=(prometheus)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
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
