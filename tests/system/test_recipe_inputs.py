"""Bad input to the recipes: a clear message and exit status 2, no traceback.
Plus the data formats, model loading, the loaders' per-epoch shuffle and the schedules.
(The full catalogue of bad inputs is in test_recipe_validation.py.)"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import ROOT

pytestmark = pytest.mark.timeout(180)


def recipe(recipe: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", f"recipes.{recipe}", "--backend", "single", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=170,
        env=full_env,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]


def in_process(capsys, recipe: str, *args: str) -> str:
    """Run the recipe's ``main`` here (no seconds of imports per case); return
    its stderr after checking for exit status 2 and no traceback."""
    import importlib

    main = importlib.import_module(f"recipes.{recipe}").main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["--backend", "single", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err[-2000:]
    return err


@pytest.fixture(scope="module")
def small_dogcat(tmp_path_factory) -> Path:
    from recipes.make_data import make_dogcat

    return make_dogcat(tmp_path_factory.mktemp("dc"), n_per_class=6, seed=1)


def test_missing_data_directory(tmp_path, capsys):
    err = in_process(capsys, "cifar10", "--data-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o"))
    assert "no CIFAR-10 data" in err and "make_data" in err
    err = in_process(capsys, "dogcat", "--data-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o"))
    assert "does not exist" in err


def test_empty_data_directory(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    assert "no images found" in in_process(capsys, "dogcat", "--data-dir", str(data), "--out-dir", str(tmp_path / "o"))
    (data / "cifar-10-batches-py").mkdir()
    err = in_process(capsys, "cifar10", "--data-dir", str(data), "--out-dir", str(tmp_path / "o"))
    assert "not a complete CIFAR-10 folder" in err


@pytest.mark.scenario  # a training run on damaged files
def test_unreadable_images_are_skipped_and_counted(small_dogcat, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(small_dogcat, data)
    (data / "train" / "cat.100.jpg").write_text("this is not a JPEG")
    good = (data / "train" / "dog.0.jpg").read_bytes()
    (data / "train" / "dog.100.jpg").write_bytes(good[: len(good) // 2])  # truncated download
    proc = recipe(
        "dogcat",
        "--data-dir",
        str(data),
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "1",
        "--epochs",
        "1",
        "--out-dir",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped 2 unreadable image file(s)" in proc.stderr
    assert "cat.100.jpg" in proc.stderr and "dog.100.jpg" in proc.stderr


def test_csv_with_wrong_columns(small_dogcat, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(small_dogcat, data)
    (data / "train.csv").write_text("file,class\ncat.0.jpg,0\n")
    err = in_process(capsys, "dogcat", "--data-dir", str(data), "--image-size", "32", "--out-dir", str(tmp_path / "o"))
    assert "expected the columns 'filename,label'" in err and "file,class" in err


def test_csv_labels_are_used(small_dogcat, tmp_path):
    import shutil

    from recipes.data import scan_dogcat

    data = tmp_path / "data"
    shutil.copytree(small_dogcat, data)
    # Labels from the CSV win over the names (here deliberately swapped for one file).
    (data / "train.csv").write_text("filename,label\ncat.0.jpg,dog\ndog.0.jpg,0\ncat.1.jpg,0\n")
    files, labels = scan_dogcat(data)
    assert [f.name for f in files] == ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg"] and labels == [1, 0, 0]


def test_image_size_too_small_for_vgg16(small_dogcat, capsys):
    err = in_process(capsys, "dogcat", "--data-dir", str(small_dogcat), "--image-size", "16")
    assert "too small for VGG16" in err and "at least 32" in err


def test_pretrained_without_network_says_what_to_do(small_dogcat, tmp_path):
    # A proxy on a closed port makes the download fail at once, network or not.
    env = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "TORCH_HOME": str(tmp_path)}
    assert_clean_error(
        recipe("dogcat", "--data-dir", str(small_dogcat), "--image-size", "32", "--pretrained", env=env),
        "could not download the ImageNet VGG16 weights",
        "--weights PATH",
    )


def test_local_imagenet_weights_and_freezing(tmp_path):
    from torchvision.models import vgg16

    from recipes.models import vgg16_for_dogcat

    torch.manual_seed(5)
    imagenet = vgg16(weights=None)  # stands in for the 1000-class ImageNet file
    torch.save(imagenet.state_dict(), tmp_path / "vgg16-imagenet.pth")
    model = vgg16_for_dogcat(weights=tmp_path / "vgg16-imagenet.pth", freeze_features=True)
    assert torch.equal(model.features[0].weight, imagenet.features[0].weight)
    assert torch.equal(model.classifier[3].weight, imagenet.classifier[3].weight)
    assert model.classifier[6].out_features == 2
    assert not any(p.requires_grad for p in model.features.parameters())
    assert all(p.requires_grad for p in model.classifier.parameters())
    torch.save({"not": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(Exception, match="not a VGG16 state dict"):
        vgg16_for_dogcat(weights=tmp_path / "other.pth")


def test_cifar10_files_are_checked_against_official_md5(tmp_path):
    from parallelx.errors import ParallelxError
    from recipes.data import GENERATED_MARKER, load_cifar10
    from recipes.make_data import make_cifar10

    folder = make_cifar10(tmp_path, n_train=20, n_test=7)
    train, test = load_cifar10(folder)  # generated: marker present, check skipped openly
    assert len(train) == 20 and len(test) == 7 and train[0][0].shape == (3, 32, 32)
    (folder / GENERATED_MARKER).unlink()  # now it claims to be the official data
    with pytest.raises(ParallelxError, match="do not match the official CIFAR-10 md5"):
        load_cifar10(folder)
    assert len(load_cifar10(folder, skip_checksum=True)[1]) == 7


def test_generated_cifar10_is_the_official_pickle_layout(tmp_path):
    import pickle

    import numpy as np

    from recipes.make_data import make_cifar10

    folder = make_cifar10(tmp_path, n_train=50, n_test=10)
    with open(folder / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    assert set(entry) == {"batch_label", "labels", "data", "filenames"}
    assert entry["data"].dtype == np.uint8 and entry["data"].shape == (10, 3072)
    with open(folder / "batches.meta", "rb") as f:
        assert pickle.load(f, encoding="latin1")["label_names"][0] == "airplane"


def test_loader_reshuffles_every_epoch_and_workers_are_per_process():
    import parallelx
    from recipes.data import default_num_workers, make_loader

    backend = parallelx.get_backend("single")
    backend.init()
    data = torch.utils.data.TensorDataset(torch.arange(40), torch.zeros(40, dtype=torch.long))
    sampler = backend.make_sampler(data, shuffle=True, seed=0)
    loader = make_loader(backend, data, sampler, batch_size=8, num_workers=0, seed=0)
    first = torch.cat([x for x, _ in loader]).tolist()
    second = torch.cat([x for x, _ in loader]).tolist()
    assert sorted(first) == sorted(second) == list(range(40)) and first != second
    keyed = make_loader(backend, data, sampler, batch_size=8, num_workers=0, seed=0, seeded_augmentation=True)
    x, _, index = next(iter(keyed))
    assert torch.equal(x, index), "batches carry each sample's dataset index"
    cores = len(os.sched_getaffinity(0))
    assert default_num_workers(cores) == 0  # one core per process: load in-process
    assert default_num_workers(1) == min(8, cores - 1)


def test_schedules_warm_up_then_follow_their_shape():
    from recipes.common import make_scheduler

    def lrs(kind: str, **kw) -> list[float]:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = make_scheduler(opt, kind, **kw)
        seen = []
        for _ in range(kw["steps"]):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    assert lrs("constant", steps=4, warmup_steps=3) == [0.25, 0.5, 0.75, 1.0]
    assert lrs("step", steps=8, warmup_steps=0) == [1.0] * 4 + [0.1] * 2 + [0.01] * 2
    cosine = lrs("cosine", steps=6, warmup_steps=1, floor=0.1)
    assert cosine[:2] == [0.5, 1.0] and cosine[1:] == sorted(cosine[1:], reverse=True)
    assert cosine[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 5)))


class _BrokenImages(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        from parallelx.errors import ParallelxError

        raise ParallelxError(f"cannot decode img{index}.jpg (OSError: broken data stream)")


def test_error_in_a_loader_worker_arrives_as_its_own_message():
    # The DataLoader re-raises a worker's error with the worker's traceback in
    # its message; the recipes' loaders pass on the message alone (one line on stderr).
    import parallelx
    from parallelx.errors import ParallelxError
    from recipes.data import make_loader

    backend = parallelx.get_backend("single")
    backend.init()
    data = _BrokenImages()
    loader = make_loader(backend, data, backend.make_sampler(data, shuffle=False), batch_size=2, num_workers=1, seed=0)
    with pytest.raises(ParallelxError) as raised:
        next(iter(loader))
    assert str(raised.value) == "cannot decode img0.jpg (OSError: broken data stream)"
