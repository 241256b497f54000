<#
.SYNOPSIS
    Installs NInfer for the current user on Windows: a desktop shortcut to the app, and with -TaskScheduler a logon
    task that runs the API server in its own session.

.DESCRIPTION
    Copies ninfer.bat (which logs stdout and stderr to %LOCALAPPDATA%\NInfer\logs) to %LOCALAPPDATA%\NInfer, makes
    an icon from resources\icons\ninfer.svg, and puts an "NInfer" shortcut on the desktop.

    -TaskScheduler registers the task "NInfer server", started at logon by Task Scheduler, so the engine does not
    run as a child of whatever tool launched it (an editor, an agent, a terminal): closing that tool, or a job
    object killing its children, no longer kills the server. It runs "ninfer.bat serve" with -ServeArgs; put
    NINFER_* settings (e.g. NINFER_API_KEY) in %APPDATA%\NInfer\serve.env, one NAME=value per line.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\windows\install.ps1
.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\windows\install.ps1 -TaskScheduler -ServeArgs "--preset cpu-default --port 8080"
.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\windows\install.ps1 -Uninstall
#>
[CmdletBinding()]
param(
    [switch]$TaskScheduler,
    [string]$ServeArgs = "",
    [string]$ScriptsDir = "",
    [switch]$NoStart,
    [switch]$Uninstall
)
$ErrorActionPreference = "Stop"

$TaskName = "NInfer server"
$AppDir = Join-Path $env:LOCALAPPDATA "NInfer"
$Desktop = [Environment]::GetFolderPath("Desktop")
$Shortcut = Join-Path $Desktop "NInfer.lnk"
$Here = Split-Path -Parent $MyInvocation.MyCommand.Path
$Root = Resolve-Path (Join-Path $Here "..\..")

if ($Uninstall) {
    if (Get-ScheduledTask -TaskName $TaskName -ErrorAction SilentlyContinue) {
        Stop-ScheduledTask -TaskName $TaskName -ErrorAction SilentlyContinue
        Unregister-ScheduledTask -TaskName $TaskName -Confirm:$false
    }
    Remove-Item -Force -ErrorAction SilentlyContinue $Shortcut
    foreach ($f in "ninfer.bat", "scripts-dir.txt", "ninfer.ico") {
        Remove-Item -Force -ErrorAction SilentlyContinue (Join-Path $AppDir $f)
    }
    Write-Host "NInfer's shortcut and logon task are removed (logs, settings and conversations are kept)."
    exit 0
}

# Where pip put ninfer.exe and ninfer-serve.exe (the virtual environment's Scripts folder).
if (-not $ScriptsDir) {
    $cmd = Get-Command "ninfer.exe" -ErrorAction SilentlyContinue
    if (-not $cmd) {
        throw "ninfer.exe is not on PATH: install NInfer first (pip install -e .) in the environment you want, or pass -ScriptsDir."
    }
    $ScriptsDir = Split-Path -Parent $cmd.Source
}
foreach ($exe in "ninfer.exe", "ninfer-serve.exe") {
    if (-not (Test-Path (Join-Path $ScriptsDir $exe))) { throw "$exe is not in $ScriptsDir." }
}

New-Item -ItemType Directory -Force -Path $AppDir, (Join-Path $AppDir "logs") | Out-Null
Copy-Item -Force (Join-Path $Here "ninfer.bat") (Join-Path $AppDir "ninfer.bat")
# UTF-8 without BOM: ninfer.bat reads it after "chcp 65001", so folders with non-ASCII names work.
[IO.File]::WriteAllText((Join-Path $AppDir "scripts-dir.txt"), $ScriptsDir, (New-Object Text.UTF8Encoding $false))

# An .ico made from the SVG with Qt (PySide6 is installed with NInfer); the exe's icon if that fails.
$Ico = Join-Path $AppDir "ninfer.ico"
$Svg = Join-Path $Root "resources\icons\ninfer.svg"
$Python = Join-Path $ScriptsDir "python.exe"
$code = @"
import sys
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer
app = QGuiApplication(['x', '-platform', 'offscreen'])
img = QImage(256, 256, QImage.Format_ARGB32)
img.fill(0)
p = QPainter(img)
QSvgRenderer(sys.argv[1]).render(p)
p.end()
sys.exit(0 if img.save(sys.argv[2], 'ICO') else 1)
"@
$IconLocation = (Join-Path $ScriptsDir "ninfer.exe") + ",0"
try {
    if (Test-Path $Python) {
        & $Python -c $code $Svg $Ico
        if ($LASTEXITCODE -eq 0 -and (Test-Path $Ico)) { $IconLocation = "$Ico,0" }
    }
} catch { }

$shell = New-Object -ComObject WScript.Shell
$lnk = $shell.CreateShortcut($Shortcut)
$lnk.TargetPath = Join-Path $AppDir "ninfer.bat"
$lnk.WorkingDirectory = $AppDir
$lnk.WindowStyle = 7  # minimized: the console only carries the log redirection
$lnk.IconLocation = $IconLocation
$lnk.Description = "NInfer: run a model on this computer behind an OpenAI-compatible API"
$lnk.Save()
Write-Host "Desktop shortcut: $Shortcut"
Write-Host "Logs:             $(Join-Path $AppDir 'logs')"

if ($TaskScheduler) {
    $bat = Join-Path $AppDir "ninfer.bat"
    $action = New-ScheduledTaskAction -Execute "cmd.exe" -Argument "/c `"`"$bat`" serve $ServeArgs`"" -WorkingDirectory $AppDir
    $trigger = New-ScheduledTaskTrigger -AtLogOn -User "$env:USERDOMAIN\$env:USERNAME"
    $settings = New-ScheduledTaskSettingsSet -AllowStartIfOnBatteries -DontStopIfGoingOnBatteries `
        -ExecutionTimeLimit ([TimeSpan]::Zero) -RestartCount 3 -RestartInterval (New-TimeSpan -Minutes 1) `
        -MultipleInstances IgnoreNew -StartWhenAvailable
    $principal = New-ScheduledTaskPrincipal -UserId "$env:USERDOMAIN\$env:USERNAME" -LogonType Interactive -RunLevel Limited
    Register-ScheduledTask -TaskName $TaskName -Action $action -Trigger $trigger -Settings $settings `
        -Principal $principal -Description "NInfer API server (ninfer-serve), started at logon in its own session." `
        -Force | Out-Null
    Write-Host "Logon task '$TaskName' registered: ninfer-serve starts at every logon, independent of any tool."
    if (-not $NoStart) {
        Start-ScheduledTask -TaskName $TaskName
        Write-Host "Started now. Check it with: curl http://127.0.0.1:8080/health (or your --port)"
    }
}
