#!/usr/bin/env bash
# The app on real X screens of 1280 x 800 and 800 x 600 with a window manager (openbox): whole-screen pictures of the
# main window, the model library's On this computer list and the launcher after Change model with LAN kept, images in
# the chat at 1280 x 800 (pending above the message box, then a thumbnail in the history; a stand-in server answers)
# (and, with the reference MCP filesystem server installed, a tool call in the chat at 1280 x 800), saved as
# NAME-WxH.png into docs/screenshots/ (or the folder given). Look at each: every window whole on the screen, its
# title bar and status bar included.
#
#   scripts/screen_check.sh [OUT_DIR]
#
# Needs: apt-get install -y xvfb openbox libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1. Uses throwaway folders for
# NINFER_HOME, HF_HOME and HOME, so your settings and models are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-docs/screenshots}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 QT_QPA_PLATFORM=xcb
for size in 1280x800 800x600; do
    mkdir -p "$work/$size/user"
    NINFER_HOME="$work/$size/home" HF_HOME="$work/$size/hf" HOME="$work/$size/user" \
        xvfb-run -a -s "-screen 0 ${size}x24" bash -c 'openbox >/dev/null 2>&1 & sleep 1; python -m app.screenshots_screen "$0"' "$out"
done
mkdir -p "$work/images/user"  # images in the chat: dropped, pasted, sent, their thumbnails in the history
NINFER_HOME="$work/images/home" HF_HOME="$work/images/hf" HOME="$work/images/user" \
    xvfb-run -a -s "-screen 0 1280x800x24" bash -c 'openbox >/dev/null 2>&1 & sleep 1; python -m app.screenshots_images "$0"' "$out"
if command -v mcp-server-filesystem >/dev/null 2>&1; then  # a tool call of the reference filesystem server
    mkdir -p "$work/mcp/user"
    NINFER_HOME="$work/mcp/home" HF_HOME="$work/mcp/hf" HOME="$work/mcp/user" \
        xvfb-run -a -s "-screen 0 1280x800x24" bash -c 'openbox >/dev/null 2>&1 & sleep 1; python -m app.screenshots_mcp "$0"' "$out"
else
    echo "screen_check.sh: mcp-server-filesystem not found (npm install -g @modelcontextprotocol/server-filesystem): no MCP pictures" >&2
fi
