"""parallelx.strategies.process_group.attempt_token: the ranks of a restarted torchrun
attempt agree on a fresh key prefix although the store still holds the keys
of earlier attempts (whose restart counts may differ from node to node)."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import torch.distributed as dist

from parallelx.errors import LaunchError
from parallelx.launching.launchers import free_port
from parallelx.strategies.process_group import attempt_token

pytestmark = pytest.mark.timeout(60)


def agree(port: int, world: int, delays: dict[int, float], timeout_s: float = 20) -> list[str | BaseException]:
    """Run attempt_token on ``world`` threads, each with its own client of the store."""
    results: list[str | BaseException] = [RuntimeError("did not finish")] * world

    def rank(r: int) -> None:
        time.sleep(delays.get(r, 0))
        client = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=dt.timedelta(seconds=timeout_s))
        try:
            results[r] = attempt_token(client, r, world, dt.timedelta(seconds=timeout_s))
        except BaseException as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30)
    )
    yield port, server


def test_ranks_agree_and_each_attempt_gets_a_new_token(store):
    port, server = store
    first = agree(port, 4, {})
    assert all(isinstance(t, str) for t in first) and len(set(first)) == 1, first
    # The next attempt: the first one's keys (hello nonces, welcomes, joins) are
    # all still there, and ranks arrive late, in any order.
    second = agree(port, 4, {0: 0.3, 2: 0.6, 3: 0.1})
    assert all(isinstance(t, str) for t in second) and len(set(second)) == 1, second
    assert second[0] != first[0]
    # A stale welcome from the dead attempt is never taken: rank 1 late, rank 0 early.
    third = agree(port, 2, {1: 0.5})
    assert len(set(third)) == 1 and third[0] not in (first[0], second[0])


def test_a_missing_rank_ends_rank_0_with_one_clear_error(store):
    port, _ = store
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=dt.timedelta(seconds=5))
    client.set("parallelx/attempts/hello/1", "stale-nonce-of-a-dead-rank")  # an earlier attempt's rank 1
    with pytest.raises(LaunchError, match=r"ranks \[1\] did not join"):
        attempt_token(client, 0, 2, dt.timedelta(seconds=1))
