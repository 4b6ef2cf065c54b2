"""One run per folder: a lock file that a second run on the same folder refuses.

Two runs started on the same log folder (a scheduler's retry while the
first attempt still runs, or the same command typed twice) would interleave
their checkpoints and logs, and each would resume from, or delete, the
other's. `FolderLock(folder).acquire()` takes the folder for this process;
a second run's `acquire()` raises `FolderLockedError`, naming the run that
holds it. Nothing here knows about TensorFlow or JAX.

The lock is the file `<folder>/.kerastower.lock`, created with
`O_CREAT | O_EXCL` (so that of two runs only one creates it), written and
fsynced, holding JSON:

    {"host": socket.gethostname(), "pid": os.getpid(),
     "started": time.time() when the lock was taken,
     "process_start": the process's start time in clock ticks, field 22 of
                      /proc/<pid>/stat (None where there is no /proc),
     "token": a random hex string}

`release()` removes the file only while it is still this lock's (same
host, pid and token). The same process may lock a folder again, through
another `FolderLock` (e.g. a log folder that is also the checkpoint
folder): the holders are counted, and the file goes when the last one
releases.

A lock is stale, and is taken over with a warning, when it was left on
this host by a process that no longer runs: its pid is gone, or is a
zombie, or now belongs to another process (its /proc start time differs
from `process_start`, the pid was reused); or when the file is not a lock
at all (garbled JSON: a run killed while writing it; a garbled file younger
than `GARBLED_GRACE_S` is waited on, since its writer may be writing it
right now; a pid or process_start that is not an integer is garbled too),
or holds a pid outside this host's range (1 to /proc/sys/kernel/pid_max:
forged or garbled, never an OverflowError from os.kill). A lock of a live process on this host, or of any process on
another host (which cannot be checked from here), is never taken over.

Example:
    >>> import os, tempfile
    >>> from kerastower.checkpoint.folder_lock import FolderLock
    >>> folder = tempfile.mkdtemp()
    >>> with FolderLock(folder) as lock:
    ...     with FolderLock(folder):            # this process again: allowed
    ...         pass
    ...     print(os.path.exists(lock.path))    # still held by the outer one
    True
    >>> os.path.exists(os.path.join(folder, ".kerastower.lock"))
    False

    `FolderLockedError` shows a second run's refusal.
"""

import datetime
import json
import os
import secrets
import socket
import threading
import time
import warnings

from kerastower.errors import KerasTowerError

__all__ = ["FolderLock", "FolderLockedError", "LOCK_NAME", "GARBLED_GRACE_S"]

LOCK_NAME = ".kerastower.lock"
GARBLED_GRACE_S = 2.0  # how long a garbled lock file may still be being written
_TAKE_OVER_ATTEMPTS = 5
_POLL_S = 0.05

# realpath of a folder -> {"token": the lock file's token, "count": holders}
# for every folder this process holds; guarded by _registry_guard.
_held = {}
_registry_guard = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child holds nothing
    os.register_at_fork(after_in_child=_held.clear)


class FolderLockedError(KerasTowerError):
    """Another live run holds the folder (see kerastower/checkpoint/folder_lock.py).

    Attributes:
        folder: the folder.
        holder: the lock file's content: host, pid, started (time.time()),
            process_start, token.

    Examples:
        >>> import json, os, tempfile
        >>> from kerastower.checkpoint.folder_lock import FolderLock, FolderLockedError
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, ".kerastower.lock"), "w") as f:
        ...     json.dump({"host": "node-7", "pid": 4242, "started": 0,
        ...                "process_start": None, "token": "ab12"}, f)
        >>> try:
        ...     FolderLock(folder).acquire()
        ... except FolderLockedError as error:
        ...     message = str(error)
        >>> print(message[message.index("process"):].split(". ")[0])
        process 4242 on host node-7, which took it at 1970-01-01 00:00:00 UTC
    """

    def __init__(self, folder, holder, path, other_host):
        message = (
            f"The folder {folder} is in use by another run: process {holder['pid']} on "
            f"host {holder['host']}, which took it at {_when(holder.get('started'))}. "
            "Two runs on one folder would interleave their checkpoints and logs. "
            "Wait for that run to end, stop it, or give this run another folder."
        )
        if other_host:
            message += (
                f" That run is on another host, so whether it still runs cannot be "
                f"checked from here: if it is gone, remove the lock file {path} by hand."
            )
        super().__init__(message)
        self.folder = folder
        self.holder = holder


class FolderLock:
    """The lock of one folder for this process; see the module's docstring.

    `acquire()` returns the lock itself and raises `FolderLockedError` when
    another live run holds the folder; `release()` gives it back (calling it
    on a lock not held does nothing). A `with FolderLock(folder):` block
    does both.

    Attributes:
        folder: the folder, as given.
        path: the lock file, `<folder>/.kerastower.lock`.

    Examples:
        >>> import os, tempfile
        >>> from kerastower.checkpoint.folder_lock import FolderLock
        >>> lock = FolderLock(tempfile.mkdtemp()).acquire()
        >>> os.path.exists(lock.path)
        True
        >>> lock.release()
        >>> os.path.exists(lock.path)
        False
    """

    def __init__(self, folder):
        self.folder = os.fspath(folder)
        self.path = os.path.join(self.folder, LOCK_NAME)
        self._key = None    # the realpath this object holds, while it holds it
        self._token = None  # the token of the lock file it counts itself on

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc_info):
        self.release()

    def acquire(self):
        if self._key is not None:
            return self
        os.makedirs(self.folder, exist_ok=True)
        key = os.path.realpath(self.folder)
        with _registry_guard:
            self._token = self._take(key)
            self._key = key
        return self

    def release(self):
        with _registry_guard:
            key, token, self._key, self._token = self._key, self._token, None, None
            entry = _held.get(key) if key is not None else None
            if entry is None or entry["token"] != token:
                return  # the file was taken from this process in between
            entry["count"] -= 1
            if entry["count"] > 0:
                return
            del _held[key]
            _, record, _ = _read(self.path)
            if (record is not None and record["host"] == socket.gethostname()
                    and record["pid"] == os.getpid() and record.get("token") == token):
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass

    def _take(self, key):
        """Takes the lock file for this process (the registry guard held);
        returns the token the file holds."""
        entry = _held.get(key)
        if entry is not None:
            _, record, _ = _read(self.path)
            if (record is not None and _is_this_process(record)
                    and record.get("token") == entry["token"]):
                entry["count"] += 1
                return entry["token"]
            del _held[key]  # the file was removed or replaced by hand: take it anew
        attempts, garbled_since = 0, None
        while True:
            token = secrets.token_hex(16)
            if self._create(token):
                _held[key] = {"token": token, "count": 1}
                return token
            raw, record, age = _read(self.path)
            if raw is None:
                continue  # it went in between: create it again
            if record is not None and _is_this_process(record):
                # Left by this process outside this registry (this module
                # loaded twice): count on it rather than refuse ourselves.
                _held[key] = {"token": record.get("token"), "count": 1}
                return record.get("token")
            if record is None:
                garbled_since = garbled_since or time.monotonic()
                if age < GARBLED_GRACE_S and time.monotonic() - garbled_since < GARBLED_GRACE_S:
                    time.sleep(_POLL_S)  # its writer may be writing it now
                    continue
                why = f"the lock file {self.path} is unreadable (a run killed while writing it)"
            else:
                garbled_since = None
                other_host = record["host"] != socket.gethostname()
                why = None if other_host else _why_stale(record)
                if why is None:
                    raise FolderLockedError(self.folder, record, self.path, other_host)
                why = (
                    f"the lock of process {record['pid']} on host {record['host']}, which "
                    f"took it at {_when(record.get('started'))}, is stale: {why}"
                )
            attempts += 1
            if attempts > _TAKE_OVER_ATTEMPTS:
                raise KerasTowerError(
                    f"Could not take the folder {self.folder}: its lock file {self.path} "
                    f"kept changing over {_TAKE_OVER_ATTEMPTS} attempts; other runs are "
                    "starting on this folder at the same time. Start one run per folder."
                )
            if self._remove_stale(raw):
                warnings.warn(f"Taking over the folder {self.folder}: {why}.", stacklevel=3)

    def _create(self, token):
        """Creates the lock file holding this process's record; False if one is there."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "process_start": _process_start(os.getpid()),
            "token": token,
        }
        data = json.dumps(record).encode()
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.remove(self.path)
            raise
        os.close(fd)
        return True

    def _remove_stale(self, raw):
        """Removes the lock file judged stale from its content `raw`. It is
        renamed away first, so that of two runs taking it over only one
        moves it; if what was moved is not `raw` (another run took the
        stale lock over in between), it is put back. True if removed."""
        moved = f"{self.path}.stale-{secrets.token_hex(8)}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        try:
            with open(moved, "rb") as f:
                same = f.read() == raw
        except OSError:
            same = False
        if not same:
            try:
                os.link(moved, self.path)  # back in place; never replaces a newer one
            except OSError:
                pass
        os.remove(moved)
        return same


def _read(path):
    """(raw bytes, record or None if garbled, age in seconds) of the lock
    file at `path`; raw is None if there is no file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
            age = time.time() - os.fstat(f.fileno()).st_mtime
    except (FileNotFoundError, NotADirectoryError):  # the folder went (or became a file)
        return None, None, 0.0
    try:
        record = json.loads(raw)
    except ValueError:
        return raw, None, age
    if not (isinstance(record, dict) and isinstance(record.get("host"), str)
            and isinstance(record.get("pid"), int) and not isinstance(record["pid"], bool)
            and (record.get("process_start") is None or (
                isinstance(record["process_start"], int)
                and not isinstance(record["process_start"], bool)))):
        return raw, None, age
    return raw, record, age


def _pid_max():
    """The largest process id this host gives: /proc/sys/kernel/pid_max
    where there is one, else 2**22 (Linux's largest)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2**22


def _stat_fields(pid):
    """The fields of /proc/<pid>/stat from field 3 (state) on; None where
    there is no such file. The command name (field 2) may hold spaces and
    parentheses, hence the split at the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _process_start(pid):
    """The start time of process `pid` in clock ticks since boot (field 22
    of /proc/<pid>/stat), or None where it cannot be read."""
    fields = _stat_fields(pid)
    try:
        return int(fields[22 - 3])
    except (TypeError, IndexError, ValueError):
        return None


def _is_this_process(record):
    return (record["host"] == socket.gethostname() and record["pid"] == os.getpid()
            and record.get("process_start") == _process_start(os.getpid()))


def _why_stale(record):
    """Why the lock `record` of a process on this host is stale, in words,
    or None if that process still runs."""
    pid = record["pid"]
    largest = _pid_max()
    if not 1 <= pid <= largest:
        # Forged or garbled: os.kill would take 0 and -n for process
        # groups, and raise OverflowError beyond a C int.
        return f"{pid} is not a process id (this host's are 1 to {largest})"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "that process no longer runs"
    except OverflowError:
        return f"{pid} is not a process id"
    except PermissionError:
        pass  # it runs, as another user
    fields = _stat_fields(pid)
    if fields and fields[0] == "Z":
        return "that process has exited (a zombie not yet reaped)"
    recorded, now = record.get("process_start"), _process_start(pid)
    if recorded is not None and now is not None and recorded != now:
        return (
            f"process id {pid} now belongs to another process (it started at clock "
            f"tick {now}, the lock's at {recorded}): the pid was reused"
        )
    return None


def _when(started):
    """A time.time() value in words, UTC."""
    try:
        moment = datetime.datetime.fromtimestamp(float(started), datetime.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return "an unknown time"
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
