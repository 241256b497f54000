#!/usr/bin/env bash
# Screenshots of the desktop app for the README: starts the app under Xvfb (a real X server, no monitor needed)
# with the embedded default model, drives a short chat, and saves PNGs of the launcher, the chat mid-answer, the
# monitor and more, also at 800 x 600, into docs/screenshots/ (or the folder given).
#
#   scripts/screenshots.sh [OUT_DIR]
#
# Needs: xvfb-run (apt-get install -y xvfb libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1). Without it, falls back
# to Qt's offscreen platform (same pixels, no X server). Uses a throwaway NINFER_HOME, so your settings and
# conversations are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/screenshots}"
home="$(mktemp -d)"
trap 'rm -rf "$home"' EXIT
export NINFER_HOME="$home" HF_HUB_OFFLINE=1
if command -v xvfb-run >/dev/null 2>&1; then
    QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python -m app.screenshots "$out"
else
    echo "screenshots.sh: xvfb-run not found; using QT_QPA_PLATFORM=offscreen" >&2
    QT_QPA_PLATFORM=offscreen python -m app.screenshots "$out"
fi
