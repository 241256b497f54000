#!/usr/bin/env bash
# Screenshots of the desktop app for the README: starts the app under Xvfb (a real X server, no monitor needed)
# with the embedded default model, drives a short chat, and saves PNGs of the launcher, the chat mid-answer, the
# monitor and more, also at 800 x 600, into docs/screenshots/ (or the folder given); then the model library (search
# with fit marks, a download under way, the models on this computer) against the tests' stand-in hub on the loopback.
#
#   scripts/screenshots.sh [OUT_DIR] [library]     (library: the model library's screenshots only)
#
# Needs: xvfb-run (apt-get install -y xvfb libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1). Without it, falls back
# to Qt's offscreen platform (same pixels, no X server). Uses a throwaway NINFER_HOME, so your settings and
# conversations are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/screenshots}"
only="${2:-}"
home="$(mktemp -d)"
trap 'rm -rf "$home"' EXIT
export NINFER_HOME="$home" HF_HUB_OFFLINE=1
shoot() {  # shoot MODULE: runs python -m MODULE OUT_DIR on an X server, else offscreen
    if command -v xvfb-run >/dev/null 2>&1; then
        QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python -m "$1" "$out"
    else
        echo "screenshots.sh: xvfb-run not found; using QT_QPA_PLATFORM=offscreen" >&2
        QT_QPA_PLATFORM=offscreen python -m "$1" "$out"
    fi
}
if [ "$only" != "library" ]; then
    shoot app.screenshots
fi
# the library's own folders: no model of this computer's user is listed, and the cache starts empty
export HF_HOME="$home/hf" HOME="$home/user" NINFER_HOME="$home/library"
mkdir -p "$HOME"
shoot app.screenshots_library
