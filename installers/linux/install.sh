#!/usr/bin/env bash
# NInfer for this user on Linux: a desktop entry and the icon in the XDG data dirs, so NInfer appears in the
# application menu; with --systemd, also a systemd *user* unit that starts ninfer-serve at login, in its own
# service (never killed with the terminal or tool that started it). No root needed.
#
#   installers/linux/install.sh                      desktop entry + icon
#   installers/linux/install.sh --systemd            ... and ninfer-serve at login (enabled and started now)
#   installers/linux/install.sh --systemd --serve-args "--preset cpu-default --port 8080"
#   installers/linux/install.sh --uninstall          removes all of it
#
# Options: --ninfer PATH / --ninfer-serve PATH (default: found on PATH), --no-enable (write the unit, do not
# enable or start it), --serve-args "ARGS". Settings for the unit go in ~/.config/ninfer/serve.env as NINFER_*=value
# lines (e.g. NINFER_API_KEY), which keeps the API key off the command line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
data_home="${XDG_DATA_HOME:-$HOME/.local/share}"
config_home="${XDG_CONFIG_HOME:-$HOME/.config}"
systemd=0 enable=1 uninstall=0 ninfer="" serve="" serve_args=""

die() { echo "install.sh: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --systemd) systemd=1 ;;
        --no-enable) enable=0 ;;
        --uninstall) uninstall=1 ;;
        --ninfer) shift; ninfer="${1:?--ninfer needs a path}" ;;
        --ninfer-serve) shift; serve="${1:?--ninfer-serve needs a path}" ;;
        --serve-args) shift; serve_args="${1-}" ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

apps="$data_home/applications"
icon_dir="$data_home/icons/hicolor/scalable/apps"
desktop="$apps/ninfer.desktop"
icon="$icon_dir/ninfer.svg"
unit_dir="$config_home/systemd/user"
unit="$unit_dir/ninfer-serve.service"
have() { command -v "$1" >/dev/null 2>&1; }

if [ "$uninstall" = 1 ]; then
    if [ -f "$unit" ] && have systemctl; then
        systemctl --user disable --now ninfer-serve.service >/dev/null 2>&1 || true
    fi
    rm -f "$desktop" "$icon" "$unit"
    if have systemctl; then systemctl --user daemon-reload >/dev/null 2>&1 || true; fi
    if have update-desktop-database; then update-desktop-database "$apps" >/dev/null 2>&1 || true; fi
    echo "NInfer's desktop entry, icon and user unit are removed (settings and conversations are kept)."
    exit 0
fi

resolve() {  # an absolute path to an executable: the one given, or the one on PATH
    local given="$1" name="$2" found
    if [ -n "$given" ]; then
        found="$(cd "$(dirname "$given")" && pwd)/$(basename "$given")"
    else
        found="$(command -v "$name" || true)"
    fi
    [ -n "$found" ] && [ -x "$found" ] || die "$name not found; install NInfer first (pip install -e .) or pass --$name PATH"
    printf '%s\n' "$found"
}
quote_exec() {  # a path as the Desktop Entry spec (and systemd) want it in Exec=: quoted, with \ " ` $ escaped
    local s="$1"
    s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//\`/\\\`}"; s="${s//\$/\\\$}"
    printf '"%s"' "$s"
}
fill() {  # fill @KEY@ placeholders of a template: fill TEMPLATE KEY VALUE ...
    local text key value
    text="$(cat "$1")"; shift
    while [ $# -gt 0 ]; do key="$1" value="$2"; shift 2; text="${text//@$key@/$value}"; done
    printf '%s\n' "$text"
}

ninfer="$(resolve "$ninfer" ninfer)"
mkdir -p "$apps" "$icon_dir"
install -m 644 "$root/resources/icons/ninfer.svg" "$icon"
fill "$here/ninfer.desktop.in" EXEC "$(quote_exec "$ninfer")" TRYEXEC "$ninfer" ICON "$icon" > "$desktop"
chmod 644 "$desktop"
if have update-desktop-database; then update-desktop-database "$apps" >/dev/null 2>&1 || true; fi
if have gtk-update-icon-cache; then gtk-update-icon-cache -q -t -f "$data_home/icons/hicolor" >/dev/null 2>&1 || true; fi
echo "Desktop entry: $desktop"
echo "Icon:          $icon"

if [ "$systemd" = 1 ]; then
    serve="$(resolve "$serve" ninfer-serve)"
    mkdir -p "$unit_dir" "$config_home/ninfer"
    fill "$here/ninfer-serve.service.in" EXEC "$(quote_exec "$serve")${serve_args:+ $serve_args}" > "$unit"
    chmod 644 "$unit"
    echo "User unit:     $unit"
    if [ "$enable" = 1 ]; then
        if have systemctl && systemctl --user show-environment >/dev/null 2>&1; then
            systemctl --user daemon-reload
            systemctl --user enable --now ninfer-serve.service
            echo "ninfer-serve starts at every login and runs now. Logs: journalctl --user -u ninfer-serve -f"
            echo "To keep it running after logout and start it at boot: loginctl enable-linger \"$USER\""
        else
            echo "No systemd user session here: enable it later with 'systemctl --user enable --now ninfer-serve'."
        fi
    else
        echo "Not enabled (--no-enable): systemctl --user daemon-reload && systemctl --user enable --now ninfer-serve"
    fi
fi
