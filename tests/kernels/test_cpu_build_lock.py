"""kernels/cpu_native.build_lock: a builder killed mid-build leaves torch's `lock` file in the build folder, which
torch's cpp_extension would wait on forever; the next builder takes the folder's flock (released by the system when
its holder died) and removes the stale file."""
import os
import subprocess
import sys
import threading

import pytest

from kernels import cpu_native

HOLD = """
import fcntl, os, sys, time
f = open(os.path.join(sys.argv[1], "builder.flock"), "a")
fcntl.flock(f, fcntl.LOCK_EX)
open(os.path.join(sys.argv[1], "lock"), "w").close()  # what torch's FileBaton leaves while it builds
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(cpu_native.fcntl is None, reason="no flock on this platform")
@pytest.mark.subprocess
def test_a_builder_killed_mid_build_leaves_no_lock_the_next_one_waits_on(tmp_path):
    """The seam is a process dying while it holds the lock: only another process can show it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        entered = threading.Event()

        def build():
            with cpu_native.build_lock(str(tmp_path)):
                entered.set()

        t = threading.Thread(target=build, daemon=True)
        t.start()
        assert not entered.wait(1.0)  # a live builder holds the folder: the next one waits
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(10.0)  # its holder died: the system released the flock
    t.join(10.0)
    assert not (tmp_path / "lock").exists()


def test_without_a_folder_of_our_own_the_lock_is_torchs_alone(tmp_path):
    with cpu_native.build_lock(None):
        pass
    (tmp_path / "lock").touch()
    with cpu_native.build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()  # no live builder holds the flock: the file was stale
    assert not os.path.exists(tmp_path / "lock")
