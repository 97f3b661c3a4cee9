"""Checkpoints in an S3-compatible object store: a real one, SeaweedFS's ``weed mini``,
started by the tests (tests/support/store.py; no mock of the store).

A store has no rename: a checkpoint is complete once its commit record is in it.
Checked here: save and resume bitwise under torchrun with 2 processes, retention
(only complete, older checkpoints go), a checkpoint without its commit record is
never taken, a wrong key or a missing bucket is one line naming the URL (never
the secret), and ``backend.save`` / ``load`` through a URL."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from launching import BIN, ROOT, launch, launcher_for, require_launcher
from store import SECRET_KEY
from trainstate_worker import Run

import parallelx
from parallelx import ParallelxError, storage
from parallelx.bigmodels.formats import INDEX
from parallelx.checkpoints.trainstate import COMMIT, is_complete, latest_checkpoint
from parallelx.launching.launchers import free_port
from recipes.models import GPT, GPTConfig


@pytest.fixture
def backend():
    with parallelx.get_backend("single") as b:
        yield b


def _steps(store, bucket: str, prefix: str = "run/checkpoints/") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key in store.keys(bucket, prefix):
        rest = key[len(prefix) :]
        if "/" in rest:
            step, file = rest.split("/", 1)
            found.setdefault(step, []).append(file)
    return found


#: test id -> the worker's options.  fsdp-sharded: every rank uploads only its shards (DCP's files, staged
#: on its local disk: the part of a save that blocks), in the background, and reads back only its slices.
STORE_RUNS = {
    "ddp": ["--backend", "ddp"],
    "fsdp-sharded": ["--backend", "fsdp", "--fsdp-sharded-checkpoints", "--background"],
}


# The launches of make test (about 30 s each); the rest of this file is a scenario but for two checks without a store.
@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(STORE_RUNS))
def test_save_and_resume_auto_from_the_store_under_torchrun(s3_env, tmp_path, name):
    store, bucket = s3_env
    require_launcher("torchrun")
    url = f"s3://{bucket}/run"
    res = launch(
        "torchrun",
        ["tests/support/store_worker.py", *STORE_RUNS[name], "--url", url, "--out", str(tmp_path)],
        timeout=240,
        env=store.env(),
    )
    assert res.returncode == 0, f"torchrun store worker failed:\n{res.tail(60)}"
    assert SECRET_KEY not in res.output
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert r["world_size"] == 2 and r["step"] == 3
    assert r["found"] == f"{url}/checkpoints/step-00000003" == r["saved"][-1]
    assert all(torch.equal(r["A"][k], r["B"][k]) for k in r["A"]), "resumed from the store, the weights differ"
    assert all(torch.equal(r["A"][k], r["loaded"][k]) for k in r["A"]), "backend.load of the URL differs"
    # save_pretrained into the store: shards from every rank's pieces, read back bit for bit.
    assert len(r["pretrained"]) == 3 and all(f.startswith(f"{url}/hf/model-") for f in r["pretrained"])
    shape = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(), torch.nn.Linear(16, 4))
    parallelx.load_pretrained(shape, f"{url}/hf")
    assert all(torch.equal(shape.state_dict()[k], v) for k, v in r["A"].items()), "save_pretrained to the URL"
    steps = _steps(store, bucket)
    # keep=2: the oldest complete one went; each one kept holds every rank's files and its commit record.
    assert sorted(steps) == ["step-00000002", "step-00000003"]
    shards = ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"] if name == "fsdp-sharded" else []
    for files in steps.values():
        assert sorted(files) == sorted([COMMIT, "rng-rank0.pt", "rng-rank1.pt", "state.pt", *shards])
    if name == "fsdp-sharded":  # each tensor is in the store as the two ranks' chunks, neither of them whole
        index = storage.dcp_reader(f"{url}/checkpoints/step-00000003/shards").read_metadata()
        tensors = {
            k: m
            for k, m in index.state_dict_metadata.items()
            if k.startswith(("model.", "optimizer.state.")) and not k.endswith(".step")  # AdamW's step: a scalar
        }
        assert len(tensors) == 3 * len(r["A"]), sorted(tensors)  # the weights, exp_avg, exp_avg_sq
        for key, meta in tensors.items():
            rows = [c.sizes[0] for c in meta.chunks]
            assert len(rows) == 2 and sum(rows) == meta.size[0] and max(rows) < meta.size[0], (key, rows)
        files = {i.relative_path for i in index.storage_data.values()}
        assert files == {"__0_0.distcp", "__1_0.distcp"}
    # Read back at world size 1 by a backend that does not shard (the whole tensors: read from the store's
    # shards), and made one portable file by the command line's conversion: the weights of A's third step.
    with parallelx.get_backend("single") as single:
        c = Run(single, "adamw", init_seed=7, dropout=0.0, noise=False)
        info = c.load(f"{url}/checkpoints/step-00000003")
        assert info["counters"]["global_step"] == 3
        assert all(torch.equal(c.weights()[k], r["at_3"][k]) for k in r["at_3"]), "a world of one read the store"


def _tmpfs_in_a_mount_namespace() -> str | None:
    """Why a launch cannot run with a small tmpfs of its own as its temporary directory, or None."""
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


@pytest.mark.scenario
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_a_full_staging_disk_fails_the_save_on_every_rank_and_the_last_checkpoint_resumes(s3_env, tmp_path):
    """fsdp's sharded checkpoints into the store, in the background, under torchrun, the ranks' temporary
    directory (where the shards are staged before their upload) a 16 MiB tmpfs of the launch's own
    mount namespace.  After the worker's checkpoints the disk is filled and one more save made: it fails
    on every rank with one line naming the checkpoint and the cause; the latest complete checkpoint stays
    the previous one, and a fresh run resumes it to the uninterrupted run's bits (the worker's B)."""
    why = _tmpfs_in_a_mount_namespace()
    if why is not None:
        pytest.skip(why)
    require_launcher("torchrun")
    store, bucket = s3_env
    url = f"s3://{bucket}/run"
    staging = tmp_path / "staging"
    staging.mkdir()
    worker = ["tests/support/store_worker.py", *STORE_RUNS["fsdp-sharded"], "--url", url, "--out", str(tmp_path)]
    cmd = launcher_for("torchrun").command([*worker, "--full-disk"], 2, port=free_port())
    mounted = f'mount -t tmpfs -o size=16m tmpfs {staging} && exec "$@"'
    env = {**os.environ, **store.env(), "TMPDIR": str(staging), "PARALLELX_TIMEOUT": "120", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounted, "sh", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    error = r["full_disk"]
    assert "\n" not in error and f"checkpoint {url}/checkpoints/step-00000005 was not completed" in error, error
    assert "No space left on device" in error and "rank 0" in error and "rank 1" in error, error
    assert r["found"] == f"{url}/checkpoints/step-00000003", "the failed save was taken"
    assert all(torch.equal(r["A"][k], r["B"][k]) for k in r["A"]), "resumed from the store, the weights differ"
    assert not store.keys(bucket, "run/checkpoints/step-00000005/commit.json")


@pytest.mark.scenario
@pytest.mark.timeout(300)
def test_a_checkpoint_without_its_commit_record_is_never_taken(s3_env, backend):
    store, bucket = s3_env
    url = f"s3://{bucket}/run"
    run = Run(backend, "sgd")
    run.train(1)
    first = run.save(url)
    run.train(1)
    second = run.save(url)
    assert latest_checkpoint(url) == second == f"{url}/checkpoints/step-00000002"
    # A crash before the commit record: every file there but the record (and `latest` naming it).
    store.client().delete_object(Bucket=bucket, Key=f"run/checkpoints/step-00000002/{COMMIT}")
    assert not is_complete(second) and is_complete(first)
    assert latest_checkpoint(url) == first
    with pytest.raises(ParallelxError, match="not a complete checkpoint"):
        Run(backend, "sgd").load(second)
    # Retention counts and deletes complete checkpoints only: the partial one stays, untouched.
    for _ in range(3):
        run.train(1)
        run.save(url, keep=1)
    steps = _steps(store, bucket)
    assert sorted(steps) == ["step-00000002", "step-00000005"], steps
    assert COMMIT not in steps["step-00000002"] and COMMIT in steps["step-00000005"]
    assert latest_checkpoint(url) == f"{url}/checkpoints/step-00000005"


@pytest.mark.scenario
def test_resume_auto_with_the_checkpointer(s3_env, backend):
    store, bucket = s3_env
    url = f"s3://{bucket}/loop"
    run = Run(backend, "adamw")
    made = parallelx.Checkpointer(backend, url, every=1, model=run.model, optimizer=run.optimizer, best=1.5)
    assert made.resume("auto") is None  # nothing there yet: a fresh start
    made["best"] = 0.25
    made.global_step = 4
    saved = made.save()
    again = parallelx.Checkpointer(backend, url, every=1, model=run.model, optimizer=run.optimizer, best=1.5)
    assert again.resume("auto") == saved == f"{url}/checkpoints/step-00000004"
    assert again["best"] == 0.25 and again.global_step == 4


@pytest.mark.scenario
def test_wrong_key_and_missing_bucket_end_with_one_line_naming_the_url(s3_env, backend, monkeypatch):
    store, bucket = s3_env
    run = Run(backend, "sgd")
    run.train(1)
    missing = "s3://px-no-such-bucket/run"
    for act in (lambda: latest_checkpoint(missing), lambda: run.save(missing)):
        with pytest.raises(ParallelxError) as exc:
            act()
        text = str(exc.value)
        assert "\n" not in text and "s3://px-no-such-bucket" in text and "does not exist" in text, text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    storage._filesystems.clear()
    url = f"s3://{bucket}/run"
    for act in (lambda: latest_checkpoint(url), lambda: run.save(url), lambda: backend.load(f"{url}/w.pt")):
        with pytest.raises(ParallelxError) as exc:
            act()
        text = str(exc.value)
        assert "\n" not in text and url in text and "access denied" in text, text
        assert "not-the-key" not in text and SECRET_KEY not in text


def test_a_url_without_the_filesystem_package_names_the_pip_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "s3fs", None)  # not installed
    storage._filesystems.clear()
    with pytest.raises(ParallelxError, match=r"pip install 'parallelx\[s3\]'"):
        storage.exists(storage.location("s3://bucket/run"))
    storage._filesystems.clear()


def test_locations():
    from pathlib import Path

    assert storage.location("runs/x") == Path("runs/x")
    assert storage.location("file:///tmp/x") == Path("/tmp/x")
    assert storage.location("s3://b/run/") == "s3://b/run"
    assert storage.join(storage.location("s3://b/run"), "checkpoints") == "s3://b/run/checkpoints"
    assert storage.show("s3://key:secret@b/run") == "s3://b/run"


def test_a_transient_failure_is_tried_the_set_number_of_times(monkeypatch):
    """A dropped connection is tried again, ``PARALLELX_STORE_ATTEMPTS`` times in all (waits doubled from
    0.5 s), then one error naming the URL, the count and the cause; a bad setting is refused."""
    waits: list[float] = []
    monkeypatch.setattr(storage.time, "sleep", waits.append)
    calls: list[int] = []

    def dropped() -> None:
        calls.append(1)
        raise ConnectionError("Connection reset by peer")

    monkeypatch.setenv("PARALLELX_STORE_ATTEMPTS", "3")
    with pytest.raises(
        storage.StoreError, match=r"reading s3://b/x failed 3 times \(ConnectionError: Connection reset"
    ):
        storage._call("s3://b/x", "reading", dropped)
    assert len(calls) == 3 and waits == [0.5, 1.0]
    monkeypatch.delenv("PARALLELX_STORE_ATTEMPTS")
    calls.clear()
    with pytest.raises(storage.StoreError, match="failed 5 times"):
        storage._call("s3://b/x", "reading", dropped)
    assert len(calls) == 5
    monkeypatch.setenv("PARALLELX_STORE_ATTEMPTS", "zero")
    with pytest.raises(ParallelxError, match="PARALLELX_STORE_ATTEMPTS must be a whole number >= 1, got 'zero'"):
        storage._call("s3://b/x", "reading", dropped)


def test_a_recipe_given_a_missing_bucket_stops_before_training_with_one_line(s3_env, tmp_path, capsys):
    """``--out-dir s3://<no such bucket>/run``: the recipe ends with exit status 2 and one line
    naming the URL and the cause, before any step (its data is read; no output is made)."""
    from recipes import cifar10
    from recipes.make_data import make_cifar10

    data = make_cifar10(tmp_path / "cifar", n_train=32, n_test=16, seed=0)
    url = "s3://px-no-such-bucket/run"
    with pytest.raises(SystemExit) as stop:
        cifar10.main(["--backend", "single", "--data-dir", str(data), "--out-dir", url, "--epochs", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and url in lines[0] and "does not exist" in lines[0], err
    assert "--out-dir" in lines[0] and SECRET_KEY not in err


def test_a_background_save_to_the_store_is_complete_only_once_committed(s3_env, backend, monkeypatch):
    """``asynchronous=True`` into the store: while the upload waits, the checkpoint has no commit
    record and the previous one stays the latest; once done, its record and ``latest`` are there."""
    import threading

    from parallelx.checkpoints import trainstate

    store, bucket = s3_env
    url = f"s3://{bucket}/bg"
    run = Run(backend, "adamw")
    run.train(1)
    first = run.save(url)
    go = threading.Event()
    save = storage.save

    def held(obj, loc, **kw):  # type: ignore[no-untyped-def]
        assert go.wait(30)
        save(obj, loc, **kw)

    monkeypatch.setattr(trainstate.storage, "save", held)
    run.train(1)
    at_save = {k: v.clone() for k, v in run.weights().items()}
    second = run.save(url, asynchronous=True)
    run.train(2)  # the weights move on while the upload waits
    assert second == f"{url}/checkpoints/step-00000002" and not is_complete(second)
    assert latest_checkpoint(url) == first
    go.set()
    parallelx.wait_for_checkpoint(backend)
    assert is_complete(second) and latest_checkpoint(url) == second
    resumed = Run(backend, "adamw", init_seed=5)
    resumed.load(second)
    assert all(torch.equal(resumed.weights()[k], at_save[k]) for k in at_save)


def _upload(url: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        storage.write(storage.join(url, name), lambda f, data=data: f.write(data))


def test_pretrained_weights_load_from_the_store_reading_only_what_is_asked(s3_env, backend, tmp_path):
    """``load_pretrained("s3://...")``: a Hugging Face folder of two safetensors shards and its index, a
    ``torch.save`` file and a ``torch.distributed.checkpoint`` folder, in the store; an eager model and one built under ``init_module`` (read at
    set-up) get the weights bit for bit; a tensor's rows are one ranged read of those bytes only; a URL
    with nothing there is one error naming it."""
    import json

    from safetensors.torch import save

    from parallelx.bigmodels.formats import open_weights

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 6))

    torch.manual_seed(0)
    source = {k: v.detach().clone() for k, v in net().state_dict().items()}
    store, bucket = s3_env
    folder = f"s3://{bucket}/pretrained/net"
    first = {k: v for k, v in source.items() if k.startswith("0.")}
    second = {k: v for k, v in source.items() if k.startswith("2.")}
    index = {
        "metadata": {},
        "weight_map": {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")},
    }
    _upload(folder, {"a.safetensors": save(first), "b.safetensors": save(second), INDEX: json.dumps(index).encode()})
    saved = tmp_path / "net.pt"
    torch.save(source, saved)
    _upload(f"s3://{bucket}/pretrained", {"net.pt": saved.read_bytes()})
    # A plain torch.distributed.checkpoint folder (PyTorch's FSDP2 example's layout: the model's entries
    # under "model."), written by DCP's own code and put in the store.
    import torch.distributed.checkpoint as dcp

    optim = {"state": {k: {"exp_avg": torch.ones_like(v)} for k, v in source.items()}}
    dcp.save({"model": source, "optim": optim}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for f in (tmp_path / "dcp").iterdir():
        storage.upload(f, f"s3://{bucket}/pretrained/dcp/{f.name}")

    for url in (folder, f"s3://{bucket}/pretrained/net.pt", f"s3://{bucket}/pretrained/dcp"):
        torch.manual_seed(1)
        eager = net()
        weights = parallelx.load_pretrained(eager, url)
        assert all(torch.equal(eager.state_dict()[k], v) for k, v in source.items()), url
        assert weights.bytes_read == weights.total_bytes() == sum(v.numel() * 4 for v in source.values())
        with parallelx.init_module():
            meta = net()
        weights = parallelx.load_pretrained(meta, url)
        assert weights.bytes_read == 0  # nothing read before set-up
        model, _ = backend.setup(meta)
        state = backend.model_state_dict(model)
        assert all(torch.equal(state[k], v) for k, v in source.items()), url

    file = open_weights(folder)
    rows = file.rows("0.weight", 5, 9)
    assert torch.equal(rows, source["0.weight"][5:9]) and file.bytes_read == 4 * 24 * 4
    with pytest.raises(ParallelxError, match="no such file or folder of weights") as missing:
        parallelx.load_pretrained(net(), f"s3://{bucket}/pretrained/none")
    assert f"s3://{bucket}/pretrained/none" in str(missing.value)


def test_convert_checkpoint_reads_and_writes_the_store(s3_env, backend, capsys):
    """``python -m parallelx convert-checkpoint s3://.../run s3://.../hf --to safetensors``: the newest
    complete checkpoint of a run in the store becomes a Hugging Face folder in the store (shards and
    their index), which ``load_pretrained`` reads back bit for bit; a whole checkpoint asked for as a
    portable file is one error naming its URL as written."""
    from parallelx.__main__ import main

    store, bucket = s3_env
    url = f"s3://{bucket}/convert"
    run = Run(backend, "adamw")
    run.train(1)
    run.save(url)
    weights = backend.model_state_dict(run.model)
    out = f"s3://{bucket}/convert-hf"
    assert main(["convert-checkpoint", url, out, "--to", "safetensors", "--max-shard-size", "300B"]) == 0
    assert f"under {out} from {url}/checkpoints/step-" in capsys.readouterr().out
    names = sorted(k.rsplit("/", 1)[-1] for k in store.keys(bucket, "convert-hf/"))
    assert INDEX in names and sum(n.endswith(".safetensors") for n in names) >= 2, names
    torch.manual_seed(5)
    fresh = Run(backend, "adamw", init_seed=5).model
    parallelx.load_pretrained(backend.unwrap(fresh), out)
    again = backend.model_state_dict(fresh)
    assert again.keys() == weights.keys() and all(torch.equal(again[k], v) for k, v in weights.items())
    with pytest.raises(SystemExit) as stop:
        main(["convert-checkpoint", url, f"s3://{bucket}/convert.pt"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "already is the portable file" in err and f"{url}/checkpoints/step-" in err, err
    assert f"s3:/{bucket}" not in err, err  # the URL as written, never folded into a path


def test_save_pretrained_into_the_store_loads_back_bit_for_bit(s3_env, backend):
    """``save_pretrained(backend, model, "s3://...", max_shard_size=...)``: shards and their index in the
    store, each uploaded whole; ``load_pretrained`` of the URL gives the weights bit for bit (a tied
    tensor stored once); saving again as one file removes the old index."""
    store, bucket = s3_env
    url = f"s3://{bucket}/saved/gpt"
    torch.manual_seed(0)
    model, _ = backend.setup(GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_embd=16, n_head=2)))
    files = parallelx.save_pretrained(backend, model, url, max_shard_size="4KB")
    keys = sorted(k.rsplit("/", 1)[-1] for k in store.keys(bucket, "saved/gpt/"))
    assert len(files) > 1 and keys == sorted([INDEX, *(str(f).rsplit("/", 1)[-1] for f in files)]), keys
    torch.manual_seed(7)
    again = GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_embd=16, n_head=2))
    parallelx.load_pretrained(again, url)
    want = backend.model_state_dict(model)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())
    parallelx.save_pretrained(backend, model, url)
    keys = sorted(k.rsplit("/", 1)[-1] for k in store.keys(bucket, "saved/gpt/"))
    assert INDEX not in keys and "model.safetensors" in keys, keys


def test_the_trackers_files_go_to_a_logger_dir_in_the_store(s3_env, tmp_path):
    """``--logger-dir s3://...`` (``log_dir=``): the CSV and TensorBoard trackers write into a local
    staging folder whose files are copied to the store as they change and at the end; what is in the
    store then is what they wrote, the CSV row for row."""
    store, bucket = s3_env
    url = f"s3://{bucket}/runs/exp1"
    with parallelx.get_backend("single", loggers="csv,tensorboard", log_dir=url) as backend:
        for step in range(1, 6):
            backend.log_metrics({"loss": 1.0 / step}, step=step)
        backend.monitor.flush()
        local = backend.monitor.run_dir
    assert not storage.is_url(str(local)) and local.is_dir()
    keys = [k[len("runs/exp1/") :] for k in store.keys(bucket, "runs/exp1/")]
    written = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert sorted(keys) == written and "metrics.csv" in keys and any("tfevents" in k for k in keys), keys
    for name in written:
        assert storage.read_bytes(f"{url}/{name}") == (local / name).read_bytes(), name
    rows = storage.read_bytes(f"{url}/metrics.csv").decode().splitlines()
    assert len(rows) == 1 + 5 and rows[1].split(",")[0] == "1", rows
