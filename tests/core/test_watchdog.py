"""The watchdog (`anytime.core.watchdog`): what a killed owner started ends and its files go; it outlives
the processes it watches while the owner's folder is left; a killed process's listener folder is found."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


WATCHED = """
import pathlib, subprocess, sys, time
from anytime.core.watchdog import watch
folder = pathlib.Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
watch([child.pid], owner_files=[str(folder / "owned-*.bin")])
(folder / "owned-1.bin").write_bytes(b"weights")  # as if killed before it could delete them
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.integration
def test_the_watchdog_ends_what_a_killed_owner_started_and_deletes_its_files(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"not the owner's")
    owner = subprocess.Popen([sys.executable, "-c", WATCHED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    assert psutil.pid_exists(child) and (tmp_path / "owned-1.bin").exists()
    owner.kill()  # SIGKILL: the owner runs no cleanup of its own
    owner.wait()
    deadline = time.time() + 10
    while time.time() < deadline and psutil.pid_exists(child) and psutil.Process(child).status() != "zombie":
        time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.bin"]


OWNS_A_TREE = """
import pathlib, shutil, subprocess, sys, time
from anytime.core.watchdog import watch
tree = pathlib.Path(sys.argv[1]) / "sockets"
(tree / "nested").mkdir(parents=True)
(tree / "nested" / "rendezvous").write_bytes(b"left by a killed engine")
child = subprocess.Popen([sys.executable, "-c", "pass"])
dog = watch([child.pid], owner_trees=[str(tree)])
child.wait()                                   # what it watched ended before the owner
print(dog.pid, flush=True)
if sys.argv[2] == "cleans-up":
    time.sleep(1.5)
    shutil.rmtree(tree)
time.sleep(120)
"""


@pytest.mark.integration
@pytest.mark.parametrize("owner", ["killed", "cleans-up"])
def test_the_watchdog_outlives_its_processes_while_the_owners_folder_is_left(tmp_path, owner):
    """An engine that ended before its owner leaves its folder to the owner: the watchdog deletes it,
    nested files and all, when the owner is killed, and ends by itself when the owner deletes it."""
    proc = subprocess.Popen([sys.executable, "-c", OWNS_A_TREE, str(tmp_path), owner], stdout=subprocess.PIPE, text=True)
    try:
        dog = psutil.Process(int(proc.stdout.readline()))
        time.sleep(1.0)
        assert dog.is_running() and (tmp_path / "sockets").exists()   # the child has ended; the folder is left
        if owner == "killed":
            proc.kill()
            proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline and dog.is_running() and dog.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.2)
        assert not dog.is_running() or dog.status() == psutil.STATUS_ZOMBIE
        assert not (tmp_path / "sockets").exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_killed_process_listener_folder_is_found_and_removed(tmp_path):
    """A process that passes file descriptors (multiprocessing's resource sharer, torch tensors through
    a queue) listens on a socket in a `pymp-*` folder of its own, without a forkserver: killed, it
    leaves the folder, which `multiprocessing_folders` finds by the socket (here through kill_and_clean)."""
    from tests.helpers import kill_and_clean

    listens = "from multiprocessing.connection import Listener; import time; l = Listener(); print(l.address, " \
              "flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", listens], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        folder = Path(proc.stdout.readline().strip()).parent
        assert folder.parent == tmp_path and folder.name.startswith("pymp-")
        kill_and_clean(proc.pid)
        proc.wait()
        assert not folder.exists()
    finally:
        proc.kill()
        proc.wait()
