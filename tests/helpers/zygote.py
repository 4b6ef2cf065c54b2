"""A zygote: one process that has imported Keras, its backend and kerastower, forking each run.

A test that starts the same script many times pays the backend's import
once (about 5 s a process on TensorFlow, 3 s on JAX) instead of every
time. Each run is still a real process of its own: it gets its own pid,
real signals, its own exit status, and a fresh backend, because nothing
of TensorFlow's or JAX's runtime exists in the zygote before the fork,
only imported modules (a run that sets up its devices would fail if one did).

    zygote = Zygote("zygote-folder", env=dict(os.environ, KERAS_BACKEND="tensorflow"))
    run = zygote.start("script.py", ["--flag"], output="out.txt")
    run.send_signal(signal.SIGTERM)
    status = run.wait(timeout=60)
    zygote.close()

The test side (`Zygote`, `Forked`) sends one JSON line a run to the zygote
(this file run as a script), which answers "pid <run id> <pid>" when it has
forked and "exit <pid> <status>" when that process has ended (-N after
signal N, as `subprocess` says it).
"""

import json
import os
import subprocess
import sys
import threading
import time

_ZYGOTE = os.path.abspath(__file__)


class Forked:
    """One run the zygote forked: a process with a pid, an exit status and its output files."""

    def __init__(self, zygote, output, errors):
        self._zygote = zygote
        self.output_path, self.errors_path = output, errors
        self.pid = None
        self.returncode = None

    def poll(self):
        """The exit status, or None while the process runs."""
        return self.returncode

    def wait(self, timeout):
        """Waits up to `timeout` s for the end; returns the exit status or raises TimeoutError."""
        with self._zygote.changed:
            if not self._zygote.changed.wait_for(
                    lambda: self.returncode is not None or self._zygote.dead, timeout):
                raise TimeoutError(f"process {self.pid} still runs {timeout} s later; its output:\n"
                                   + self.stdout[-3000:])
        if self.returncode is None:
            raise AssertionError(f"the zygote died: {self._zygote.log_text()[-3000:]}")
        return self.returncode

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def kill(self):
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended first
            pass

    @property
    def stdout(self):
        with open(self.output_path, errors="replace") as f:
            return f.read()

    @property
    def stderr(self):
        if self.errors_path == self.output_path:
            return ""
        with open(self.errors_path, errors="replace") as f:
            return f.read()


class Zygote:
    """Starts the zygote process (with `env`); `start` forks a run of a script in it."""

    def __init__(self, folder, env=None):
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._log = open(os.path.join(self.folder, "zygote.log"), "w")
        self.process = subprocess.Popen([sys.executable, _ZYGOTE], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log)
        self.changed = threading.Condition()
        self.dead = False
        self._runs, self._by_pid, self._count = {}, {}, 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            word, key, value = line.split()
            with self.changed:
                if word == "pid":
                    run = self._runs.pop(key)
                    run.pid = int(value)
                    self._by_pid[run.pid] = run
                else:
                    self._by_pid.pop(int(key)).returncode = int(value)
                self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()

    def log_text(self):
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def start(self, script, args, output=None, errors=None, env=None):
        """Forks a run of `script` with `args`; its stdout goes to `output`
        and its stderr to `errors` (`output` too when not given). Returns
        the `Forked` run once it has a pid."""
        with self.changed:
            self._count += 1
            key = str(self._count)
        output = output or os.path.join(self.folder, f"run-{key}.out")
        run = Forked(self, str(output), str(errors or output))
        with self.changed:
            self._runs[key] = run
        request = dict(id=key, script=os.path.abspath(script), args=[str(a) for a in args],
                       output=run.output_path, errors=run.errors_path, env=env or {})
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: run.pid is not None or self.dead, 60):
                raise AssertionError(f"the zygote forked nothing in 60 s: {self.log_text()[-3000:]}")
        if run.pid is None:
            raise AssertionError(f"the zygote died: {self.log_text()[-3000:]}")
        return run

    def run(self, script, args, timeout=300, **files):
        """Forks a run and waits for its end; returns the `Forked` run."""
        run = self.start(script, args, **files)
        run.wait(timeout)
        return run

    def close(self):
        """Ends the zygote; a run still going is killed."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


# -- the zygote process ------------------------------------------------------------


def _serve():
    import select
    import signal

    import importlib

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = importlib.import_module("keras")
    for name in ("numpy", "kerastower", keras.backend.backend()):
        importlib.import_module(name)
    pending, children, reading = b"", set(), True
    while reading or children:
        if reading and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                print("pid", request["id"], pid, flush=True)
            if not reading:  # the test side closed: nothing more will wait for these
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
        elif not reading:
            time.sleep(0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)


def _child(request):
    """Runs the script as `python script args` would, in this forked process; never returns."""
    import runpy
    import traceback

    status = 0
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        if request["errors"] == request["output"]:
            os.dup2(output, 2)
        else:
            os.dup2(os.open(request["errors"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.update(request["env"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exit:
        if isinstance(exit.code, int) or exit.code is None:
            status = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        import atexit

        atexit._run_exitfuncs()  # as the interpreter's own exit would
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


if __name__ == "__main__":
    _serve()
