"""A watchdog for processes we start but do not parent directly (vLLM's engine core and its workers,
a local Ray cluster): when their owner dies, however it dies (SIGKILL, the OOM killer), it kills
them and everything they started within a second, so nothing keeps running or holds the owner's
pipes open. It exits by itself once everything it watches has ended.

`watch(pids)` starts one as a detached process (`python -m anytime.core.watchdog OWNER PID... [--remove GLOB]
[--remove-tree DIR]`); the globs and folders name what the owner deletes itself when it lives (weights
handed to an engine, an engine's socket folder), which the watchdog deletes when it does not, as it
does the multiprocessing folders (`pymp-*`) of the owner and of what it kills. While any of them is
left it keeps watching the owner, even once the processes have ended (a killed engine leaves its
sockets; its owner may die later).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable

POLL_SECONDS = 0.5


def watch(pids: Iterable[int], owner: int | None = None, owner_files: Iterable[str] = (),
          owner_trees: Iterable[str] = ()) -> subprocess.Popen | None:
    """Kill `pids` and their descendants when `owner` (default: this process) dies, and delete the
    files that match the `owner_files` globs and the `owner_trees` folders."""
    pids = [int(p) for p in pids]
    if not pids:
        return None
    owner = os.getpid() if owner is None else owner
    removes = [arg for pattern in owner_files for arg in ("--remove", pattern)]
    removes += [arg for folder in owner_trees for arg in ("--remove-tree", folder)]
    return subprocess.Popen([sys.executable, "-m", "anytime.core.watchdog", str(owner), *map(str, pids), *removes],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)


def children() -> set[int]:
    """This process's children but Python's multiprocessing helpers: the resource tracker must
    outlive a killed owner, since it is what unlinks the shared memory and semaphores left behind."""
    import psutil

    helpers = ("resource_tracker", "forkserver")
    found = set()
    for proc in psutil.Process().children(recursive=False):
        try:
            if not any(h in " ".join(proc.cmdline()) for h in helpers):
                found.add(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def _same(pid: int, born: float) -> bool:
    """`pid` is still the process started at `born` (pids are recycled)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.create_time() == born and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _shared_memory(procs: list) -> set[str]:
    """The /dev/shm files the processes map (vLLM's message queues, semaphores)."""
    import psutil

    files = set()
    for proc in procs:
        try:
            files.update(m.path for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm/"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return files


def multiprocessing_folders(procs: list) -> set[str]:
    """The folders of Python's multiprocessing (`pymp-*`) that the processes own: those where they or
    their descendants hold a socket (a forkserver's, or the resource sharer's listener that passes file
    descriptors, e.g. torch tensors through a queue), unless a process outside them holds one there
    too (a forked child inherits its parent's listener; that folder is the parent's). A process that
    exits cleanly removes its own; a killed one never does."""
    import psutil

    family: set[int] = set()
    for proc in procs:
        try:
            family |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    mine, elsewhere = set(), set()
    for conn in psutil.net_connections(kind="unix"):
        folder = os.path.dirname(conn.laddr) if isinstance(conn.laddr, str) else ""
        if os.path.basename(folder).startswith("pymp-"):
            (mine if conn.pid in family else elsewhere).add(folder)
    return mine - elsewhere


def _mapped_anywhere(path: str) -> bool:
    import psutil

    for proc in psutil.process_iter():
        try:
            if any(m.path == path for m in proc.memory_maps(grouped=True)):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _kill_trees(targets: dict[int, float]) -> None:
    """SIGKILL the targets and their descendants, then remove the shared memory they left mapped
    (killed processes never unlink it, and /dev/shm is RAM) and their multiprocessing folders."""
    import psutil

    victims = []
    for pid, born in targets.items():
        if not _same(pid, born):
            continue
        proc = psutil.Process(pid)
        victims += [proc, *proc.children(recursive=True)]
    shared, folders = _shared_memory(victims), multiprocessing_folders(victims)
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)
    for path in shared:
        if os.path.exists(path) and not _mapped_anywhere(path):
            try:
                os.unlink(path)
            except OSError:
                pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _remove(patterns: list[str], trees: list[str] = ()) -> None:
    """Delete the files the globs match, in order (a matched folder only once it is empty), then the
    folders `trees` with everything in them."""
    for path in (p for pattern in patterns for p in glob.glob(pattern)):
        try:
            os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
        except OSError:
            pass
    for folder in trees:
        shutil.rmtree(folder, ignore_errors=True)


def _left(patterns: list[str], trees: list[str]) -> bool:
    """Whether any of the owner's files or folders is still there to delete."""
    return any(glob.glob(pattern) for pattern in patterns) or any(os.path.exists(folder) for folder in trees)


def main(argv: list[str]) -> int:
    import psutil

    parser = argparse.ArgumentParser(prog="python -m anytime.core.watchdog")
    parser.add_argument("owner", type=int)
    parser.add_argument("pids", type=int, nargs="+")
    parser.add_argument("--remove", action="append", default=[], help="glob of files to delete when the owner dies")
    parser.add_argument("--remove-tree", action="append", default=[], help="folder to delete when the owner dies")
    args = parser.parse_args(argv)
    trees = args.remove_tree
    owner, pids = args.owner, args.pids
    targets = {}
    for pid in pids:
        try:
            targets[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            pass
    try:
        owner_born = psutil.Process(owner).create_time()
    except psutil.NoSuchProcess:
        _remove(args.remove)
        _kill_trees(targets)
        _remove(args.remove, trees)
        return 0
    held: set[str] = set()   # the owner's multiprocessing folders (its forkserver's socket), seen so far
    while any(_same(pid, born) for pid, born in targets.items()) or _left(args.remove, trees):
        if not _same(owner, owner_born):
            _remove(args.remove)  # the owner can write no more of them
            _kill_trees(targets)
            _remove(args.remove, trees)  # and nor can what it started, now ended
            for folder in held:
                shutil.rmtree(folder, ignore_errors=True)
            return 0
        try:
            held |= multiprocessing_folders([psutil.Process(owner)])
        except psutil.NoSuchProcess:
            pass
        time.sleep(POLL_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
