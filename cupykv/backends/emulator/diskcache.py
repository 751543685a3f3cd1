"""The emulator's build cache on disk (``$CUPYKV_CACHE_DIR/emulator``): one build per artifact.

Several processes (pytest workers, notebooks, the CLI) share the cache. For each artifact
``X.so``:

- a lock, ``fcntl.flock`` on ``X.so.lock``, is held while ``X.so`` is built. A second process
  that needs ``X.so`` meanwhile waits, then finds it built. The kernel releases a lock when its
  holder dies, so a killed compile never blocks anyone. (Lock files are empty and stay.)
- every temporary of the build is named ``X.<random>.tmp...`` and the result is renamed into
  place, so ``X.so`` is always whole.
- before building, the temporaries a killed build left behind are deleted: those of ``X``
  (under ``X``'s lock no live process can own one) and those of any artifact older than
  :func:`stale_after` seconds (no live build is that old: g++ runs under a time limit).
"""

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from . import host

STALE_AFTER = 3600.0   # seconds; at least twice the compile timeout


def stale_after():
    """Age in seconds past which any build temporary is abandoned: 1 hour, or twice the compile timeout."""
    return max(STALE_AFTER, 2 * host.compile_timeout())


def temporary_prefix(path):
    """The prefix of every temporary of artifact ``path`` (``mod-<key>.``)."""
    return Path(path).stem + "."


def build_once(path, build):
    """Calls ``build()`` to make ``path`` unless it exists; returns whether it built.

    ``build`` must write only temporaries named with :func:`temporary_prefix` in ``path``'s
    folder and rename its result to ``path``.
    """
    path = Path(path)
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if path.exists():   # built by another process while this one waited
            return False
        sweep_temporaries(path)
        build()
        return True


@contextlib.contextmanager
def _locked(path):
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes or the process dies
        yield


def _is_temporary(entry):
    if entry.name.endswith((".tmp", ".tmp.so")):
        return True
    # cuemu-<random>: the work folders of older versions
    return entry.name.startswith("cuemu-") and not entry.name.startswith("cuemu-runtime-") and entry.is_dir()


def sweep_temporaries(path):
    """Delete the temporaries of ``path`` (call under its lock) and every stale temporary in its folder."""
    path = Path(path)
    own, oldest = temporary_prefix(path), time.time() - stale_after()
    with os.scandir(path.parent) as entries:
        for entry in entries:
            if not _is_temporary(entry):
                continue
            try:
                if not entry.name.startswith(own) and entry.stat(follow_symlinks=False).st_mtime > oldest:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:   # another process swept it first
                pass
