@echo off
rem NInfer launcher for Windows.
rem   ninfer.bat                 the desktop app
rem   ninfer.bat serve [flags]   the API server alone (what the logon task of install.ps1 -TaskScheduler runs)
rem Output and errors go to log files in %LOCALAPPDATA%\NInfer\logs (app.out.log / app.err.log,
rem serve.out.log / serve.err.log), so nothing is lost when no console is open (Task Scheduler, shortcut).
rem NINFER_* settings may be put in %APPDATA%\NInfer\serve.env, one NAME=value per line (# starts a comment),
rem for example NINFER_API_KEY=..., which keeps the key off the command line.
setlocal EnableExtensions DisableDelayedExpansion
chcp 65001 >nul
set "PYTHONUTF8=1"
set "PYTHONUNBUFFERED=1"
set "LOGDIR=%LOCALAPPDATA%\NInfer\logs"
if not exist "%LOGDIR%" mkdir "%LOGDIR%"

set "ENVFILE=%APPDATA%\NInfer\serve.env"
if exist "%ENVFILE%" (
    for /f "usebackq eol=# tokens=1,* delims==" %%A in ("%ENVFILE%") do set "%%A=%%B"
)

rem Where ninfer.exe and ninfer-serve.exe are: install.ps1 writes the folder next to this file; else PATH.
set "SCRIPTS="
if exist "%~dp0scripts-dir.txt" set /p SCRIPTS=<"%~dp0scripts-dir.txt"

set "MODE=app"
set "EXE=ninfer"
if /i "%~1"=="serve" (
    set "MODE=serve"
    set "EXE=ninfer-serve"
    shift
)
set "ARGS="
:collect
if "%~1"=="" goto run
set ARGS=%ARGS% %1
shift
goto collect

:run
if defined SCRIPTS set "EXE=%SCRIPTS%\%EXE%.exe"
echo ==== %DATE% %TIME% starting %EXE%%ARGS% >> "%LOGDIR%\%MODE%.out.log"
"%EXE%"%ARGS% >> "%LOGDIR%\%MODE%.out.log" 2>> "%LOGDIR%\%MODE%.err.log"
set "CODE=%ERRORLEVEL%"
echo ==== %DATE% %TIME% exited with %CODE% >> "%LOGDIR%\%MODE%.out.log"
exit /b %CODE%
