"""A training-state checkpoint writer SIGKILLed at random moments, in a
process of its own: what it leaves is either complete or ignored."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from launching import ROOT
from trainstate_worker import Run

import parallelx
from parallelx.checkpoints.trainstate import latest_checkpoint

CRASH_SCRIPT = """
import sys, torch, parallelx
sys.path.insert(0, 'tests/support')
from trainstate_worker import Run
with parallelx.get_backend('single') as backend:
    run = Run(backend, 'adamw', hidden=600)
    print('ready', flush=True)
    while True:
        run.train(1)
        run.save(sys.argv[1], keep=2)
"""


@pytest.mark.scenario  # writers killed over and over: a minute
def test_sigkill_during_writes_never_leaves_a_torn_checkpoint(tmp_path):
    rng = random.Random(0)
    loads = 0
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3 + rng.random())
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        path = latest_checkpoint(tmp_path)
        if path is None:
            continue
        for f in path.iterdir():
            torch.load(f, weights_only=True)  # complete: every file reads
        with parallelx.get_backend("single") as backend:
            run = Run(backend, "adamw", hidden=600)
            run.load(path)
        loads += 1
    assert loads >= 2, "the writer was killed before any checkpoint was complete; give it more time"
