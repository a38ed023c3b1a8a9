"""tqkv_server.py - a real tqkv-server process for the Python tests.

ServerProcess starts `server` with args (which should listen on 127.0.0.1:0), reads the
port it prints ("listening on ...:PORT", then "metrics on port N" when want_metrics),
keeps its stderr lines (stderr_lines, log_tail), and stops it with SIGTERM (stop: the exit
code, or a "hung (killed ...)" string after timeout) or SIGKILL (kill). The start-up
wait is bounded by the server's own output (readline), not by sleeps. Subclasses add
their clients (a grpc channel and stub, a data-channel socket).
"""

import signal
import subprocess
import threading
import time


class ServerProcess:
    def __init__(self, server, args, env=None, start_timeout=30, want_metrics=False,
                 drain_stdout=False):
        self.proc = subprocess.Popen([server] + list(args), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.port = None
        self.metrics_port = None
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "listening on" in line:
                self.port = int(line.strip().rsplit(":", 1)[1])
                break
        if self.port is not None and want_metrics:
            line = self.proc.stdout.readline()
            if "metrics on port" in line:
                self.metrics_port = int(line.split()[-1])
        if self.port is None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("server did not start: " + self.proc.stderr.read())
        self.addr = "127.0.0.1:%d" % self.port
        self.stderr_lines = []
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
        for _ in self.proc.stdout:
            pass

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
        self._t.join(timeout=5)
        if self._t2 is not None:
            self._t2.join(timeout=5)
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass

    def log_tail(self, n=20):
        return "".join(self.stderr_lines[-n:])
