"""installers/: the Linux installer writes a valid desktop entry, icon and systemd user unit into the XDG dirs (checked
with desktop-file-validate and systemd-analyze verify when those tools exist); the Windows files keep their shape."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "installers" / "linux" / "install.sh"


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def installed(tmp_path):
    bin_dir = tmp_path / "bin dir ü"  # spaces and non-ASCII in the executable's path
    ninfer, serve = _fake_exe(bin_dir / "ninfer"), _fake_exe(bin_dir / "ninfer-serve")
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               HOME=str(tmp_path))
    result = subprocess.run(["bash", str(INSTALL), "--systemd", "--no-enable", "--ninfer", str(ninfer),
                             "--ninfer-serve", str(serve), "--serve-args", "--preset cpu-default --port 8080"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return tmp_path, env, ninfer, serve


def test_linux_install_writes_entry_icon_and_unit(installed):
    tmp, env, ninfer, serve = installed
    desktop = tmp / "data" / "applications" / "ninfer.desktop"
    icon = tmp / "data" / "icons" / "hicolor" / "scalable" / "apps" / "ninfer.svg"
    unit = tmp / "config" / "systemd" / "user" / "ninfer-serve.service"
    text = desktop.read_text(encoding="utf-8")
    assert f'Exec="{ninfer}"' in text and f"Icon={icon}" in text and "Name=NInfer" in text
    assert icon.read_bytes() == (ROOT / "resources" / "icons" / "ninfer.svg").read_bytes()
    unit_text = unit.read_text(encoding="utf-8")
    assert f'ExecStart="{serve}" --preset cpu-default --port 8080' in unit_text
    assert "WantedBy=default.target" in unit_text and "Restart=on-failure" in unit_text
    assert "EnvironmentFile=-%E/ninfer/serve.env" in unit_text


@pytest.mark.subprocess
def test_desktop_file_validates(installed):
    tool = shutil.which("desktop-file-validate")
    if tool is None:
        pytest.skip("desktop-file-validate is not installed (apt-get install desktop-file-utils)")
    tmp, *_ = installed
    result = subprocess.run([tool, str(tmp / "data" / "applications" / "ninfer.desktop")], capture_output=True,
                            text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.subprocess
def test_systemd_unit_verifies(installed):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    tmp, *_ = installed
    unit = tmp / "config" / "systemd" / "user" / "ninfer-serve.service"
    result = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp / "broken.service"  # the check is real: a missing executable fails it
    broken.write_text(unit.read_text().replace(str(installed[3]), str(tmp / "missing")))
    assert subprocess.run([tool, "verify", str(broken)], capture_output=True, timeout=60).returncode != 0


@pytest.mark.subprocess
def test_linux_uninstall_removes_it(installed):
    tmp, env, *_ = installed
    result = subprocess.run(["bash", str(INSTALL), "--uninstall"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert not (tmp / "data" / "applications" / "ninfer.desktop").exists()
    assert not (tmp / "config" / "systemd" / "user" / "ninfer-serve.service").exists()


@pytest.mark.subprocess
def test_linux_install_says_what_is_missing(tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "d"), XDG_CONFIG_HOME=str(tmp_path / "c"),
               PATH="/usr/bin:/bin")
    result = subprocess.run(["bash", str(INSTALL), "--ninfer", str(tmp_path / "nope")], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "not found" in result.stderr


@pytest.mark.subprocess
def test_windows_files():
    bat = (ROOT / "installers" / "windows" / "ninfer.bat").read_bytes()
    assert b"\r\n" in bat and b"\n" not in bat.replace(b"\r\n", b"")  # cmd.exe wants CRLF everywhere
    text = bat.decode("ascii")
    assert "ninfer-serve" in text and '2>> "%LOGDIR%\\%MODE%.err.log"' in text and ">> \"%LOGDIR%\\%MODE%.out.log\"" in text
    assert "%LOCALAPPDATA%\\NInfer\\logs" in text and "chcp 65001" in text
    ps1 = (ROOT / "installers" / "windows" / "install.ps1").read_text(encoding="utf-8")
    for needle in ("[switch]$TaskScheduler", "Register-ScheduledTask", "New-ScheduledTaskTrigger -AtLogOn",
                   "CreateShortcut", "ninfer.bat", "serve $ServeArgs", "-Uninstall"):
        assert needle in ps1, needle
    pwsh = shutil.which("pwsh")
    if pwsh:  # parse without running
        script = ROOT / "installers" / "windows" / "install.ps1"
        check = ("$e=$null; [System.Management.Automation.Language.Parser]::ParseFile('%s',[ref]$null,[ref]$e) | "
                 "Out-Null; if ($e) { $e; exit 1 }" % script)
        assert subprocess.run([pwsh, "-NoProfile", "-Command", check], timeout=60).returncode == 0
