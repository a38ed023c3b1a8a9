"""tqkv_server.py - a real tqkv-server process for the Python tests.

ServerProcess starts `server` with args (which should listen on 127.0.0.1:0), reads the
port it prints ("listening on ...:PORT", then "metrics on port N" when want_metrics; plain
or JSON log lines), keeps its stderr lines (stderr_lines, log_tail; or, with stderr_path,
stderr goes to that file: stderr_text) and, with drain_stdout, its later stdout lines
(stdout_lines), and stops it with SIGTERM (stop: the exit code, or a "hung (killed ...)"
string after timeout) or SIGKILL (kill). The start-up wait is bounded by the server's own
output (readline), not by sleeps; a server that exits or never prints its port raises
ServerStartError (why, the exit code, its stderr). wait_stderr waits for a log line (an
event: the drain thread wakes it), not for a time. stdin is /dev/null. The one fixture
every Python test starts servers with: subclasses add their clients (a grpc channel and
stub, a data-channel socket).
"""

import re
import signal
import subprocess
import threading
import time


class ServerStartError(RuntimeError):
    """The server did not print its port: why ("exited with N", or no line in time), its
    exit code (None when it was killed for hanging) and everything it wrote to stderr."""

    def __init__(self, why, returncode, stderr):
        super().__init__("server did not start (%s): %s" % (why, stderr))
        self.why, self.returncode, self.stderr = why, returncode, stderr


class ServerProcess:
    def __init__(self, server, args, env=None, start_timeout=30, want_metrics=False,
                 drain_stdout=False, stderr_path=None):
        self.stderr_path = stderr_path
        self._errf = open(stderr_path, "w") if stderr_path else None
        self._cv = threading.Condition()
        self.proc = subprocess.Popen([server] + list(args), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._errf or subprocess.PIPE,
                                     text=True, env=env)
        self._t = self._t2 = None
        self.stderr_lines = []
        if self.proc.stderr is not None:  # drained from the start: a full pipe never blocks it
            self._t = threading.Thread(target=self._drain, daemon=True)
            self._t.start()
        self.port = None
        self.metrics_port = None
        self.listen_addr = None  # the address as the listening line prints it
        self.stdout_lines = []
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.stdout_lines.append(line)
            m = re.search(r'listening on ([^\s"]+):(\d+)', line)
            if m:
                self.listen_addr = "%s:%s" % (m.group(1), m.group(2))
                self.port = int(m.group(2))
                break
        if self.port is not None and want_metrics:
            line = self.proc.stdout.readline()
            self.stdout_lines.append(line)
            m = re.search(r"metrics on port (\d+)", line)
            if m:
                self.metrics_port = int(m.group(1))
        if self.port is None:
            try:  # stdout closed: the server is exiting
                rc = self.proc.wait(timeout=10)
                why = "exited with %d" % rc
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                rc, why = None, "no 'listening on' line in %ss" % start_timeout
            if self._t is not None:
                self._t.join(timeout=5)
            err = self.stderr_text()
            self.close()
            raise ServerStartError(why, rc, err)
        self.addr = "127.0.0.1:%d" % self.port
        if drain_stdout:  # a server that keeps printing must not block on a full pipe
            self._t2 = threading.Thread(target=self._drain_out, daemon=True)
            self._t2.start()

    def _drain(self):
        for line in self.proc.stderr:
            with self._cv:
                self.stderr_lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_stderr(self, pattern, timeout=30):
        """The first re.search(pattern) match in a stderr line, waiting up to timeout for
        the line to be written (woken by each new line); None when the server exits or the
        time runs out first."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        while True:
            # Checked before the scan: a line written just before the exit is still seen.
            done = self.proc.poll() is not None and (self._t is None or not self._t.is_alive())
            if self._errf is not None:  # stderr in a file: read what is there
                lines, seen = self.stderr_text().splitlines(), 0
            else:
                with self._cv:
                    lines = self.stderr_lines[seen:]
            for line in lines:
                m = rx.search(line)
                if m:
                    return m
            seen += len(lines)
            left = end - time.monotonic()
            if left <= 0 or done:
                return None
            if self._errf is not None:
                time.sleep(min(left, 0.05))
            else:
                with self._cv:
                    if len(self.stderr_lines) == seen:
                        self._cv.wait(min(left, 1.0))

    def _drain_out(self):
        for line in self.proc.stdout:
            self.stdout_lines.append(line)

    def stderr_text(self):
        """Everything the server wrote to stderr so far (the file with stderr_path)."""
        if self._errf is not None:
            if not self._errf.closed:
                self._errf.flush()
            with open(self.stderr_path, errors="replace") as f:
                return f.read()
        with self._cv:
            return "".join(self.stderr_lines)

    def stop(self, timeout=30):
        """SIGTERM, then the exit code; a server still running after timeout is killed
        and reported as a string (never equal to 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = "hung (killed after %ds)" % timeout
        self.close()
        return rc

    def kill(self):
        """SIGKILL: the server vanishes mid-whatever."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self):
        if self._t is not None:
            self._t.join(timeout=5)
        if self._t2 is not None:
            self._t2.join(timeout=5)
        for f in (self.proc.stdout, self.proc.stderr, self._errf):
            if f is None:
                continue
            try:
                f.close()
            except Exception:
                pass

    def log_tail(self, n=20):
        return "".join(self.stderr_text().splitlines(True)[-n:])
