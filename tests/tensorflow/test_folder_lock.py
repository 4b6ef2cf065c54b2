"""One run per folder (kerastower/checkpoint/folder_lock.py), with real
processes: a second run refuses, a killed run's lock is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kerastower.checkpoint import folder_lock
from kerastower.checkpoint.folder_lock import LOCK_NAME, FolderLock, FolderLockedError

from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(folder_lock.__file__)))

# The children import folder_lock without kerastower/__init__.py (which
# loads Keras and a backend, seconds per child): empty parent packages
# stand in for it. So each child starts in milliseconds and checks that
# the module itself needs neither TensorFlow nor JAX.
CHILD_PRELUDE = f"""
import os, sys, time, types
for name, sub in (("kerastower", ""), ("kerastower.checkpoint", "checkpoint")):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join({PACKAGE!r}, sub)]
    sys.modules[name] = module
from kerastower.checkpoint.folder_lock import FolderLock, FolderLockedError
assert not {{"tensorflow", "jax", "keras"}} & set(sys.modules), "folder_lock imported a backend"
"""


def run_child(code, **kwargs):
    return subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + code],
        capture_output=True, text=True, timeout=60, **kwargs,
    )


def start_child(code):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def lock_record(folder):
    with open(os.path.join(folder, LOCK_NAME)) as f:
        return json.load(f)


def write_lock(folder, **fields):
    record = {"host": socket.gethostname(), "pid": 1, "started": time.time(),
              "process_start": None, "token": "f0" * 16}
    record.update(fields)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK_NAME), "w") as f:
        json.dump(record, f)
    return record


def proc_stat(pid):
    """The fields of /proc/<pid>/stat from the state (field 3) on."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def start_ticks(pid):
    """Field 22 of /proc/<pid>/stat, read here independently of folder_lock."""
    return int(proc_stat(pid)[19])


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def test_a_second_process_refuses_a_folder_this_process_holds(tmp_path):
    folder = str(tmp_path / "logs")
    with FolderLock(folder) as lock:
        record = lock_record(folder)
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        assert len(record["token"]) == 32 and abs(record["started"] - time.time()) < 60
        child = run_child(f"""
try:
    FolderLock({folder!r}).acquire()
except FolderLockedError as error:
    print(error)
    print("folder:", error.folder, "holder pid:", error.holder["pid"])
    sys.exit(3)
print("acquired")
""")
        assert child.returncode == 3, child.stdout + child.stderr
        message = child.stdout
        assert f"process {os.getpid()} on host {socket.gethostname()}" in message
        assert f"The folder {folder} is in use" in message
        assert time.strftime("%Y-%m-%d", time.gmtime(record["started"])) in message
        assert "Wait for that run to end, stop it, or give this run another folder" in message
        assert "by hand" not in message  # same host: it was checked, nothing to remove
        assert f"holder pid: {os.getpid()}" in message
        assert lock_record(folder) == record  # the refusal left the lock alone
        assert os.path.exists(lock.path)
    assert not os.path.exists(os.path.join(folder, LOCK_NAME))


def kill_holder(folder, reap=True):
    """Starts a child that takes `folder` and sleeps, SIGKILLs it; its pid."""
    child = start_child(f"""
FolderLock({folder!r}).acquire()
print("held", flush=True)
time.sleep(60)
""")
    try:
        assert child.stdout.readline().strip() == "held", child.stderr.read()
        assert lock_record(folder)["pid"] == child.pid
        os.kill(child.pid, signal.SIGKILL)
        if reap:
            child.wait(timeout=30)
        else:
            while proc_stat(child.pid)[0] != "Z":
                time.sleep(0.01)
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child


def test_the_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path):
    folder = str(tmp_path)
    child = kill_holder(folder)
    assert lock_record(folder)["pid"] == child.pid  # SIGKILL left its lock behind
    with pytest.warns(UserWarning, match=rf"process {child.pid} on host .*no longer runs"):
        lock = FolderLock(folder).acquire()
    assert lock_record(folder)["pid"] == os.getpid()
    assert sorted(os.listdir(folder)) == [LOCK_NAME]  # the stale file is gone, not set aside
    lock.release()
    assert os.listdir(folder) == []


@needs_proc
def test_the_lock_of_a_killed_but_unreaped_process_is_taken_over(tmp_path):
    """A zombie still answers kill(pid, 0), but runs no more."""
    folder = str(tmp_path)
    child = kill_holder(folder, reap=False)
    try:
        with pytest.warns(UserWarning, match=rf"process {child.pid} .*zombie"):
            FolderLock(folder).acquire().release()
    finally:
        child.wait()


def test_of_many_processes_taking_over_one_stale_lock_at_once_one_wins(tmp_path):
    folder = str(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    write_lock(folder, pid=int(gone.stdout))  # its process has ended
    go = time.time() + 0.5
    children = [start_child(f"""
import warnings
warnings.simplefilter("ignore")
time.sleep(max(0.0, {go!r} - time.time()))
try:
    lock = FolderLock({folder!r}).acquire()
except FolderLockedError as error:
    print("refused", error.holder["pid"], flush=True)
else:
    print("won", os.getpid(), flush=True)
    time.sleep(1.0)   # held while the others try
    lock.release()
""") for _ in range(8)]
    outcomes = [child.communicate(timeout=60) for child in children]
    assert all(child.returncode == 0 for child in children), outcomes
    results = [out.split() for out, _ in outcomes]
    winners = [int(pid) for kind, pid in results if kind == "won"]
    assert len(winners) == 1, results
    assert all(int(pid) == winners[0] for kind, pid in results if kind == "refused"), results
    assert os.listdir(folder) == []  # the winner released; no stale copies left


def test_a_lock_taken_by_another_run_after_being_judged_stale_is_put_back(tmp_path):
    """The narrow race the test above rarely hits: the stale file was
    already replaced by the winner's lock when a loser moves it away. The
    loser compares what it moved with what it judged, and puts it back."""
    folder = str(tmp_path)
    judged = json.dumps({"host": socket.gethostname(), "pid": 999999999}).encode()
    winner = write_lock(folder, pid=1, token="aa" * 16)
    assert FolderLock(folder)._remove_stale(judged) is False
    assert lock_record(folder) == winner
    assert os.listdir(folder) == [LOCK_NAME]  # and no moved copy is left
    with open(os.path.join(folder, LOCK_NAME), "rb") as f:
        assert FolderLock(folder)._remove_stale(f.read()) is True  # the judged one goes
    assert os.listdir(folder) == []


def test_one_process_may_hold_a_folder_twice_and_the_last_release_removes_the_file(tmp_path):
    folder = str(tmp_path / "run")
    path = os.path.join(folder, LOCK_NAME)
    outer = FolderLock(folder).acquire()
    token = lock_record(folder)["token"]
    os.symlink(folder, str(tmp_path / "alias"))
    inner = FolderLock(str(tmp_path / "alias")).acquire()  # the same folder, another name
    assert lock_record(folder)["token"] == token
    outer.release()
    assert lock_record(folder)["token"] == token  # inner still holds it
    outer.release()  # a second release of the same object counts for nothing
    assert os.path.exists(path)
    inner.release()
    assert not os.path.exists(path)

    # The file is removed only while it is still this lock's.
    for foreign in ({"pid": 1}, {"pid": os.getpid(), "token": "ee" * 16}):
        lock = FolderLock(folder).acquire()
        record = write_lock(folder, **foreign)  # another holder replaced it by hand
        lock.release()
        assert lock_record(folder) == record
        os.remove(path)
    with FolderLock(folder):  # nothing left held: taken afresh
        assert lock_record(folder)["pid"] == os.getpid()
    assert not os.path.exists(path)


def test_a_garbled_lock_file_is_taken_over_with_a_warning(tmp_path):
    folder = str(tmp_path)
    path = os.path.join(folder, LOCK_NAME)
    with open(path, "w") as f:
        f.write('{"host": "node-3", "pi')  # a run killed while writing it
    old = time.time() - 3600
    os.utime(path, (old, old))
    with pytest.warns(UserWarning, match="unreadable"):
        lock = FolderLock(folder).acquire()
    assert lock_record(folder)["pid"] == os.getpid()
    lock.release()
    assert os.listdir(folder) == []


@pytest.mark.parametrize("pid", [2**40, 2**63, 0, -5, True, 1.5, "42"])
def test_a_lock_whose_pid_is_no_process_id_is_taken_over_with_a_warning(tmp_path, pid):
    """A forged or garbled pid (beyond what os.kill takes, below 1, not an
    integer) is a garbage lock: taken over with a warning, never a raw error."""
    folder = str(tmp_path)
    path = write_lock(folder, pid=pid) and os.path.join(folder, LOCK_NAME)
    old = time.time() - 3600
    os.utime(path, (old, old))
    with pytest.warns(UserWarning, match="Taking over the folder") as warned:
        lock = FolderLock(folder).acquire()
    message = str(warned[0].message)
    assert "not a process id" in message or "unreadable" in message, message
    if isinstance(pid, int) and not isinstance(pid, bool):
        assert f"{pid} is not a process id" in message
    assert lock_record(folder)["pid"] == os.getpid()
    lock.release()


def test_a_lock_whose_process_start_is_no_count_is_garbage(tmp_path):
    folder = str(tmp_path)
    write_lock(folder, pid=os.getppid(), process_start="yesterday")
    path = os.path.join(folder, LOCK_NAME)
    old = time.time() - 3600
    os.utime(path, (old, old))
    with pytest.warns(UserWarning, match="Taking over the folder .*unreadable"):
        FolderLock(folder).acquire().release()


def test_a_lock_file_being_written_is_waited_on_not_taken_over(tmp_path):
    """Between another run's O_EXCL create and its write the file is
    empty: that run is alive and gets the folder."""
    folder = str(tmp_path)
    path = os.path.join(folder, LOCK_NAME)
    open(path, "w").close()
    record = {"host": "node-3", "pid": 77, "started": 0, "process_start": None, "token": "ab"}

    def finish_writing():
        time.sleep(0.3)
        with open(path, "w") as f:
            json.dump(record, f)

    writer = threading.Thread(target=finish_writing)
    writer.start()
    try:
        with pytest.raises(FolderLockedError, match="process 77 on host node-3"):
            FolderLock(folder).acquire()
    finally:
        writer.join()
    assert lock_record(folder) == record


@needs_proc
def test_a_reused_pid_is_not_taken_for_the_run_that_locked(tmp_path):
    folder = str(tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(sleeper.pid)
        # The lock of that very process: alive, so refused.
        write_lock(folder, pid=sleeper.pid, process_start=ticks)
        with pytest.raises(FolderLockedError, match=rf"process {sleeper.pid} on host"):
            FolderLock(folder).acquire()
        # A lock of an earlier process that had the same pid: stale.
        write_lock(folder, pid=sleeper.pid, process_start=ticks - 1)
        with pytest.warns(UserWarning, match=rf"process {sleeper.pid} .*pid was reused"):
            lock = FolderLock(folder).acquire()
        assert lock_record(folder)["pid"] == os.getpid()
        assert lock_record(folder)["process_start"] == start_ticks(os.getpid())
        lock.release()
        assert sleeper.poll() is None  # only the file was touched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_of_another_host_is_refused_and_says_how_to_remove_it(tmp_path):
    folder = str(tmp_path)
    path = os.path.join(folder, LOCK_NAME)
    # pid 999999999 runs nowhere here: the host, not the pid, must decide.
    record = write_lock(folder, host="elsewhere-host", pid=999999999, started=1.7e9)
    with pytest.raises(FolderLockedError) as caught:
        FolderLock(folder).acquire()
    message = str(caught.value)
    assert "process 999999999 on host elsewhere-host" in message
    assert "2023-11-14 22:13:20 UTC" in message
    assert f"remove the lock file {path} by hand" in message
    assert caught.value.folder == folder and caught.value.holder == record
    assert lock_record(folder) == record


def test_the_module_docstring_examples_run(tmp_path):
    """pytest does not collect module doctests in this project: run them here."""
    tests = examples_of(folder_lock)
    assert sum(len(test.examples) for test in tests) >= 10
    failures = run_examples(tests, tmp_path)
    assert not failures, failures[-3000:]
