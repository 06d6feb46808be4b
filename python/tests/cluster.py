"""A real optimus cluster for the Python tests: optimus-coord and S
optimus-shard processes on this machine (UCX over `lo`), started from the
binaries Bazel puts in the test's runfiles ($OPTIMUS_BIN_DIR overrides, e.g.
bazel-bin when run by hand). Every process is killed when the cluster stops.
"""

import os
import signal
import subprocess
import tempfile
import time


def bin_root():
    candidates = [os.environ.get("OPTIMUS_BIN_DIR")]
    if os.environ.get("TEST_SRCDIR"):
        candidates.append(os.path.join(os.environ["TEST_SRCDIR"], "optimus"))
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(here, "..", "..", "bazel-bin"))
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "server", "optimus-shard")):
            return os.path.abspath(c)
    raise RuntimeError("optimus-coord/optimus-shard not found: run through bazel test "
                       "//python:python_test or set OPTIMUS_BIN_DIR=bazel-bin")


def python_path():
    """The folder to put on PYTHONPATH so that `import optimus` finds the
    package with its built extension."""
    candidates = [os.environ.get("OPTIMUS_PYTHONPATH"),
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "optimus", "_C.so")):
            return c
    raise RuntimeError("optimus/_C.so not found: run through bazel test //python:python_test "
                       "or set OPTIMUS_PYTHONPATH to a folder holding optimus/ and its _C.so")


class Cluster:
    def __init__(self, shards=2, checkpoint_dir=None, work_dir=None):
        self.dir = work_dir or tempfile.mkdtemp(prefix="optimus-pytest-")
        os.makedirs(self.dir, exist_ok=True)
        self.checkpoint_dir = checkpoint_dir
        self.procs = []
        self.shard_procs = []
        root = bin_root()
        port_file = os.path.join(self.dir, "coord.port")
        args = [os.path.join(root, "coordinator", "optimus-coord"), "--listen=127.0.0.1:0",
                f"--port_file={port_file}", "--lease_ms=2000"]
        if checkpoint_dir:
            args.append(f"--checkpoint_dir={checkpoint_dir}")
        self._spawn(args, "coord.log")
        port = ""
        give_up = time.monotonic() + 30
        while not port and time.monotonic() < give_up:
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.read().strip()
            if not port:
                time.sleep(0.05)
        if not port:
            self.stop()
            raise RuntimeError("optimus-coord did not start: " + self.log("coord.log"))
        self.address = f"127.0.0.1:{port}"
        for i in range(shards):
            args = [os.path.join(root, "server", "optimus-shard"),
                    f"--coordinator={self.address}", "--kind=host", "--net_devices=lo",
                    "--memory_limit_mb=256"]
            if checkpoint_dir:
                args.append(f"--checkpoint_dir={checkpoint_dir}")
            self.shard_procs.append(self._spawn(args, f"shard-{i}.log"))
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            if all("registered" in self.log(f"shard-{i}.log") for i in range(shards)):
                break
            time.sleep(0.05)
        else:
            self.stop()
            raise RuntimeError("shards did not register: " + self.log("shard-0.log"))

    def _spawn(self, args, log_name):
        log = open(os.path.join(self.dir, log_name), "wb")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def kill_shard(self, i):
        p = self.shard_procs[i]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs = []
