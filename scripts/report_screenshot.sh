#!/usr/bin/env bash
# The screenshot of a run's report page that docs/report.md shows: the curves, the eval table and one sample open (a
# completion of the last step's first group whose rewards differ, one of its longest up to 48 trained tokens with an
# advantage, its tokens shaded by advantage), in headless
# Chromium (scripts/install_test_tools.sh installs Debian's chromium).
#
#   scripts/report_screenshot.sh runs/demo_cpu docs/report_demo_cpu.png
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 RUN_DIR OUT.png" >&2
  exit 2
fi
run=$1
out=$2
python=${PYTHON:-.venv/bin/python}
"$python" -m cluster.cli report "$run" --out "$run/report.html" >/dev/null
fragment=$("$python" - "$run/samples.jsonl" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train = [r for r in records if r.get("kind") == "train"]
last = [r for r in train if r["step"] == max(r["step"] for r in train)]
group = next((r for r in last if r["mixed"]), last[0])
completion = max(group["completions"], key=lambda c: (bool(c["advantage"]), min(c["loss_tokens"], 48)))
print(f"train/{group['step']}/{group['group_id']}/{completion['index']}")
EOF
)
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless=new --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --user-data-dir="$profile" --hide-scrollbars --window-size=1400,3600 \
  --virtual-time-budget=5000 --screenshot="$out" "file://$(realpath "$run")/report.html#$fragment" 2>/dev/null
"$python" - "$out" <<'EOF'
import sys
from PIL import Image, ImageChops
image = Image.open(sys.argv[1]).convert("RGB")
box = ImageChops.difference(image, Image.new("RGB", image.size, "white")).getbbox()
if box is not None:  # the page's white margin below its end
    image.crop((0, 0, image.width, min(image.height, box[3] + 16))).save(sys.argv[1], optimize=True)
EOF
echo "wrote $out (sample $fragment)"
