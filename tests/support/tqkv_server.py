"""tqkv_server.py - a real tqkv-server process for the Python tests.

ServerProcess starts `server` with args (which should listen on 127.0.0.1:0), reads the
port it prints ("listening on ...:PORT", then "metrics on port N" when want_metrics; plain
or JSON log lines), keeps its stderr lines (stderr_lines, log_tail; or, with stderr_path,
stderr goes to that file: stderr_text) and, with drain_stdout, its later stdout lines
(stdout_lines), and stops it with SIGTERM (stop: the exit code, or a "hung (killed ...)"
string after timeout) or SIGKILL (kill). The start-up wait is bounded by the server's own
output (readline), not by sleeps. The one fixture every Python test starts servers with:
subclasses add their clients (a grpc channel and stub, a data-channel socket).
"""

import re
import signal
import subprocess
import threading
import time


class ServerProcess:
    def __init__(self, server, args, env=None, start_timeout=30, want_metrics=False,
                 drain_stdout=False, stderr_path=None):
        self.stderr_path = stderr_path
        self._errf = open(stderr_path, "w") if stderr_path else None
        self.proc = subprocess.Popen([server] + list(args), stdout=subprocess.PIPE,
                                     stderr=self._errf or subprocess.PIPE, text=True, env=env)
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
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("server did not start: " + self.stderr_text())
        self.addr = "127.0.0.1:%d" % self.port
        self.stderr_lines = []
        self._t = None
        if self.proc.stderr is not None:
            self._t = threading.Thread(target=self._drain, daemon=True)
            self._t.start()
        self._t2 = None
        if drain_stdout:  # a server that keeps printing must not block on a full pipe
            self._t2 = threading.Thread(target=self._drain_out, daemon=True)
            self._t2.start()

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

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
        if self._t is None:  # before start-up finished: the pipe itself
            return self.proc.stderr.read()
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
