"""Run by tests/system/test_failures.py: this rank's forensics thread is inside a call to a real
TCP store (its server stopped with SIGSTOP) when the script ends; the server is let go while the
interpreter finalises.  The process must exit 0, not abort ("terminate called", exit 134)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from parallelx.forensics import exchange
from parallelx.forensics.record import Recorder

SERVER = (
    "import datetime, time; import torch.distributed as d; "
    "s = d.TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False); "
    "print(s.port, flush=True); time.sleep(30)"
)

if __name__ == "__main__":
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    f = exchange.Forensics(1, 2, dist.PrefixStore(exchange.PREFIX, client), 30.0, recorder=Recorder()).start()
    os.kill(server.pid, signal.SIGSTOP)
    time.sleep(0.8)  # the thread's next check (every 0.5 s) now waits on the stopped server
    # Let the server answer 0.1 s from now, as this process finalises, and end it a little later.
    subprocess.Popen(["sh", "-c", f"sleep 0.1; kill -CONT {server.pid}; sleep 2; kill {server.pid}"])
    f.close()  # what Backend.shutdown does (parallelx.forensics.stop)
    print("forensics_exit: closed", flush=True)
