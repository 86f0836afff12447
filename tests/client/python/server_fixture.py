"""A real attention_server on 127.0.0.1:0 for the Python client's tests.

The binary is $ATTENTION_SERVER (CTest passes the build's); it is started
with --port_file, waited for (at most 20 s) until health is SERVING, and
stopped with SIGTERM (SIGKILL after 20 s). It also dies with the test process
(PR_SET_PDEATHSIG), so no server outlives a killed test run.
"""
import ctypes
import os
import signal
import subprocess
import tempfile
import time

import attention_client

GOLDEN_DIR = os.environ.get("ATTENTION_GOLDEN_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "golden"))
MODELS_DIR = os.environ.get("ATTENTION_MODELS_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "models"))
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Server:
    """One attention_server; `target` is its "127.0.0.1:PORT"."""

    def __init__(self, model_repository=None, flags=()):
        binary = os.environ.get("ATTENTION_SERVER")
        if not binary:
            raise RuntimeError("set ATTENTION_SERVER to the attention_server binary")
        self._dir = tempfile.TemporaryDirectory(prefix="attention_py_")
        port_file = os.path.join(self._dir.name, "port")
        self.log_path = os.path.join(self._dir.name, "server.log")
        args = [binary, "--listen", "127.0.0.1:0", "--port_file", port_file,
                "--model_repository", model_repository or MODELS_DIR, "--drain_seconds", "2",
                *flags]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=_die_with_parent)
        try:
            self.port = self._wait_for_port(port_file)
            self.target = f"127.0.0.1:{self.port}"
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self, port_file):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the server exited ({self._process.returncode}):\n{self.log()}")
            try:
                with open(port_file) as f:
                    text = f.read().strip()
                if text:
                    return int(text)
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no port file after 20 s:\n{self.log()}")

    def wait_serving(self, client):
        """Returns once `client`'s health check says SERVING (at most 20 s)."""
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline:
            try:
                status = client.health(timeout=2)
                if status == "SERVING":
                    return
            except attention_client.AttentionError as e:
                status = str(e)
            time.sleep(0.1)
        raise RuntimeError(f"health is {status}, not SERVING, after 20 s:\n{self.log()}")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()
