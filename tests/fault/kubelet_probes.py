#!/usr/bin/env python3
"""Emulates the kubelet's probes of the shard pods, with the Helm chart's settings.

Reads shard.livenessProbe and shard.readinessProbe (initialDelaySeconds,
periodSeconds, timeoutSeconds, failureThreshold) from the chart's
values.yaml, finds each optimus-shard process of a local cluster by its
--metrics_port, and probes its /healthz (liveness) and /readyz (readiness)
over HTTP as the kubelet would: the first probe initialDelaySeconds after
the process appeared, then one every periodSeconds, a probe failing when it
gets no 2xx/3xx answer within timeoutSeconds. failureThreshold liveness
failures in a row restart the container: here the shard is killed
(SIGKILL), which loses its state as a restart would. failureThreshold
readiness failures in a row make it not ready; one success makes it ready.

Also follows the local cluster's stderr (--events): the drill's coordinator
kill and restart lines, and rank 0's progress lines, so that each probe records
the phase of the outage (before, down, back), and a sample every 2 s the
step training had reached.

Runs until the process --until_pid exits, then writes a JSON summary to
--out. Exit status 0 unless the emulator itself failed.
"""
import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import yaml


def probe_settings(values_path):
    with open(values_path) as f:
        values = yaml.safe_load(f)
    shard = values["shard"]
    out = {}
    for kind in ("livenessProbe", "readinessProbe"):
        p = shard[kind]
        out[kind] = {
            "initialDelaySeconds": float(p.get("initialDelaySeconds", 0)),
            "periodSeconds": float(p.get("periodSeconds", 10)),
            "timeoutSeconds": float(p.get("timeoutSeconds", 1)),
            "failureThreshold": int(p.get("failureThreshold", 3)),
        }
    return out


def find_shard_pid(port):
    """The pid of the optimus-shard whose command line has --metrics_port=PORT."""
    want = f"--metrics_port={port}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"optimus-shard") and want in args:
            return int(entry)
    return None


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def http_probe(port, path, timeout):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return 200 <= r.status < 400, f"{r.status}"
    except urllib.error.HTTPError as e:
        return 200 <= e.code < 400, f"{e.code}"
    except Exception as e:  # Refused, reset, timed out: a failure.
        return False, type(e).__name__


class Events:
    """Follows the local cluster's stderr: the outage phase and rank 0's step."""

    KILLED = re.compile(r"killed optimus-coord \(SIGKILL\) at step (\d+)")
    RESTARTED = re.compile(r"restarted optimus-coord at step (\d+)")
    STEP = re.compile(r"^step (\d+)/")

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.phase = "before"
        self.step = 0
        self.killed_at = None  # monotonic time the kill line was seen
        self.restarted_at = None
        self.partial = ""

    def poll(self):
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except OSError:
            return
        data = self.partial + data
        lines = data.split("\n")
        self.partial = lines.pop()
        for line in lines:
            m = self.STEP.search(line)
            if m:
                self.step = max(self.step, int(m.group(1)))
            m = self.KILLED.search(line)
            if m and self.killed_at is None:
                self.phase = "down"
                self.killed_at = time.monotonic()
                self.step = max(self.step, int(m.group(1)))
            m = self.RESTARTED.search(line)
            if m and self.restarted_at is None:
                self.phase = "back"
                self.restarted_at = time.monotonic()
                self.step = max(self.step, int(m.group(1)))


class Prober(threading.Thread):
    def __init__(self, index, port, kind, settings, state, lock, stop):
        super().__init__(daemon=True)
        self.index, self.port, self.kind, self.s = index, port, kind, settings
        self.state, self.lock, self.stop = state, lock, stop

    def run(self):
        st = self.state
        path = "/healthz" if self.kind == "livenessProbe" else "/readyz"
        due = st["started"] + self.s["initialDelaySeconds"]
        while not self.stop.is_set():
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            due += self.s["periodSeconds"]
            if st["killed"] or not alive(st["pid"]):
                return
            ok, detail = http_probe(self.port, path, self.s["timeoutSeconds"])
            with self.lock:
                rec = st[self.kind]
                rec["probes"] += 1
                phase = st["events"].phase
                rec["by_phase"].setdefault(phase, {"ok": 0, "failed": 0})
                rec["by_phase"][phase]["ok" if ok else "failed"] += 1
                if ok:
                    rec["consecutive_failures"] = 0
                else:
                    rec["failures"] += 1
                    rec["consecutive_failures"] += 1
                    rec["last_failure"] = detail
                if self.kind == "readinessProbe":
                    was = rec["ready"]
                    if ok:
                        rec["ready"] = True
                    elif rec["consecutive_failures"] >= self.s["failureThreshold"]:
                        rec["ready"] = False
                    if rec["ready"] != was:
                        rec["transitions"].append({"ready": rec["ready"], "phase": phase,
                                                   "step": st["events"].step})
                elif rec["consecutive_failures"] >= self.s["failureThreshold"]:
                    # The kubelet restarts the container: the shard's state is gone.
                    print(f"kubelet_probes: shard {self.index} failed liveness "
                          f"{rec['consecutive_failures']} times in a row ({detail}): "
                          f"restarting it (SIGKILL)", file=sys.stderr, flush=True)
                    try:
                        os.kill(st["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    st["killed"] = True
                    st["killed_in_phase"] = phase
                    return


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", required=True, help="the chart's values.yaml")
    ap.add_argument("--ports", required=True, help="the shards' metrics ports, comma-separated")
    ap.add_argument("--until_pid", type=int, required=True,
                    help="probe until this process (the local cluster) exits")
    ap.add_argument("--events", required=True, help="the local cluster's stderr")
    ap.add_argument("--out", required=True, help="JSON summary written here")
    args = ap.parse_args()

    settings = probe_settings(args.values)
    ports = [int(p) for p in args.ports.split(",")]
    events = Events(args.events)
    lock = threading.Lock()
    stop = threading.Event()
    shards = []
    threads = []
    pending = list(enumerate(ports))
    samples = []  # Every 2 s: (phase, step, seconds since start).
    t0 = time.monotonic()
    next_sample = t0
    period = 2.0
    while alive(args.until_pid):
        with lock:
            events.poll()
        for item in list(pending):
            i, port = item
            pid = find_shard_pid(port)
            if pid is None:
                continue
            pending.remove(item)
            st = {"index": i, "port": port, "pid": pid, "started": time.monotonic(),
                  "killed": False, "events": events}
            for kind in ("livenessProbe", "readinessProbe"):
                st[kind] = {"probes": 0, "failures": 0, "consecutive_failures": 0,
                            "by_phase": {}}
            st["readinessProbe"].update({"ready": False, "transitions": []})
            shards.append(st)
            for kind in ("livenessProbe", "readinessProbe"):
                t = Prober(i, port, kind, settings[kind], st, lock, stop)
                t.start()
                threads.append(t)
        now = time.monotonic()
        if now >= next_sample:
            with lock:
                samples.append({"phase": events.phase, "step": events.step,
                                "t": round(now - t0, 1)})
            next_sample += period
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    with lock:
        events.poll()
    outage = None
    if events.killed_at is not None and events.restarted_at is not None:
        outage = round(events.restarted_at - events.killed_at, 1)
    summary = {
        "settings": settings,
        "shards_found": len(shards),
        "shards_expected": len(ports),
        "restarted_by_liveness": [s["index"] for s in shards if s["killed"]],
        "outage_seconds_seen": outage,
        "samples": samples,
        "shards": [{k: v for k, v in s.items() if k not in ("events", "started")}
                   for s in shards],
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
