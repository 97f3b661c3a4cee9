"""A catalogue of wrong options and damaged inputs to the recipes: each must
stop the run before training with one line, ``error: ...``, naming what was
wrong, and exit status 2, never a traceback.

Most cases call the recipe's ``main`` in this process (a subprocess costs
seconds of imports per case); the errors they reach before training are the
same ones a command line reaches.  A handful of real subprocess runs prove the
end-to-end behaviour: the three ways of starting a recipe, an error after the
backend is initialised, and a run stopped in the middle of training.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from launching import ROOT

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------- fixtures
_RNG = np.random.default_rng(0)  # garbage bytes, the same on every run


def garbage(n: int) -> bytes:
    return _RNG.bytes(n)


def _pickle(path: Path, obj: object) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def _zeros_like_shapes(shapes: dict[str, tuple[int, ...]], fill: float = 0.0) -> dict[str, torch.Tensor]:
    # Expanded one-element tensors: the right shapes at the cost of one number each,
    # so a "full" VGG16 state dict saves to a few kilobytes.
    return {k: torch.full((1,), fill).expand(s) for k, s in shapes.items()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Every damaged input of the catalogue, by name."""
    from torchvision.models import vgg11

    from recipes.data import CIFAR_DIR
    from recipes.make_data import make_cifar10, make_dogcat
    from recipes.models import LeNet, _vgg16_shapes

    base = tmp_path_factory.mktemp("inputs")
    p: dict[str, Path] = {"base": base}
    p["cifar"] = make_cifar10(base / "cifar", n_train=20, n_test=7).parent
    p["dogcat"] = make_dogcat(base / "dogcat", n_per_class=3, seed=1)
    p["file"] = base / "a_file.txt"
    p["file"].write_text("not a directory\n")
    p["missing"] = base / "does-not-exist"
    p["under_file"] = p["file"] / "out"
    p["dangling"] = base / "dangling"
    p["dangling"].symlink_to(base / "nowhere")

    # CIFAR-10 folders with one file damaged.
    good = (p["cifar"] / CIFAR_DIR / "data_batch_1").read_bytes()
    entry = pickle.loads(good, encoding="latin1")
    n = len(entry["labels"])

    def cifar(
        name: str, file: str = "data_batch_1", *, raw: bytes | None = None, obj: object = None, **changes: object
    ) -> None:
        folder = base / f"cifar_{name}"
        shutil.copytree(p["cifar"], folder)
        target = folder / CIFAR_DIR / file
        if raw is not None:
            target.write_bytes(raw)
        elif obj is not None:
            _pickle(target, obj)
        elif changes:
            _pickle(target, {**entry, **changes})
        else:
            target.unlink()
        p[f"cifar_{name}"] = folder

    cifar("no_batch3", "data_batch_3")
    cifar("no_meta", "batches.meta")
    cifar("garbage", raw=garbage(4096))
    cifar("truncated", "data_batch_2", raw=good[: len(good) // 2])
    cifar("empty_file", "test_batch", raw=b"")
    cifar("text_file", raw=b"label,pixels\n1,2\n")
    cifar("a_list", obj=[1, 2, 3])
    cifar("no_labels", obj={"data": entry["data"]})
    cifar("narrow_rows", data=np.zeros((n, 1024), np.uint8))
    cifar("hwc_4d", data=np.zeros((n, 32, 32, 3), np.uint8))
    cifar("float_data", data=entry["data"].astype(np.float32))
    cifar("list_data", data=entry["data"].tolist())
    cifar("few_labels", labels=entry["labels"][:-1])
    cifar("label_12", labels=[12, *entry["labels"][1:]])
    cifar("label_neg", labels=[*entry["labels"][:-1], -1])
    cifar("label_str", labels=["cat"] * n)
    cifar("label_float", labels=[0.5] * n)
    cifar("meta_garbage", "batches.meta", raw=b"\x80\x02garbage")
    cifar("meta_3_names", "batches.meta", obj={"label_names": ["a", "b", "c"]})
    folder = base / "cifar_batch_is_dir"
    shutil.copytree(p["cifar"], folder)
    (folder / CIFAR_DIR / "data_batch_4").unlink()
    (folder / CIFAR_DIR / "data_batch_4").mkdir()
    p["cifar_batch_is_dir"] = folder
    p["cifar_folder_is_file"] = base / "cifar_folder_is_file"
    p["cifar_folder_is_file"].mkdir()
    (p["cifar_folder_is_file"] / CIFAR_DIR).write_text("")

    # Dogs-vs-Cats folders.
    def dogcat(name: str, csv: str | bytes | None = None) -> Path:
        folder = base / f"dogcat_{name}"
        shutil.copytree(p["dogcat"], folder)
        if isinstance(csv, str):
            (folder / "train.csv").write_text(csv)
        elif isinstance(csv, bytes):
            (folder / "train.csv").write_bytes(csv)
        p[f"dogcat_{name}"] = folder
        return folder

    dogcat("csv_empty", "")
    dogcat("csv_header_only", "filename,label\n")
    dogcat("csv_columns", "file,class\ncat.0.jpg,0\n")
    dogcat("csv_label_2", "filename,label\ncat.0.jpg,0\ndog.0.jpg,2\n")
    dogcat("csv_label_bird", "filename,label\ncat.0.jpg,bird\n")
    dogcat("csv_label_half", "filename,label\ncat.0.jpg,0\ndog.0.jpg,0.5\n")
    dogcat("csv_label_blank", "filename,label\ncat.0.jpg,\n")
    dogcat("csv_duplicate", "filename,label\ncat.0.jpg,0\ndog.0.jpg,1\ncat.0.jpg,0\n")
    dogcat("csv_missing_file", "filename,label\ncat.0.jpg,0\ncat.77.jpg,0\n")
    dogcat("csv_outside", "filename,label\ncat.0.jpg,0\n../../etc/passwd,1\n")
    dogcat("csv_absolute", "filename,label\n/etc/hostname,1\n")
    dogcat("csv_blank_name", "filename,label\ncat.0.jpg,0\n ,1\n")
    dogcat("csv_ragged", "filename,label\ncat.0.jpg,0,extra,fields\n")
    dogcat("csv_binary", garbage(300))
    (dogcat("csv_is_dir") / "train.csv").mkdir()
    one = dogcat("one_image")
    for f in (one / "train").iterdir():
        if f.name != "cat.0.jpg":
            f.unlink()
    broken = dogcat("all_unreadable")
    for f in (broken / "train").iterdir():
        f.write_bytes(f.read_bytes()[:100])
    p["empty_dir"] = base / "empty_dir"
    p["empty_dir"].mkdir()

    # --weights files.
    w = base / "weights"
    w.mkdir()
    torch.save(LeNet().state_dict(), w / "lenet.pth")
    (w / "garbage.pth").write_bytes(garbage(2048))
    (w / "empty.pth").write_bytes(b"")
    lenet_bytes = (w / "lenet.pth").read_bytes()
    (w / "truncated.pth").write_bytes(lenet_bytes[: len(lenet_bytes) // 2])
    torch.save(torch.zeros(3), w / "tensor.pth")
    torch.save([torch.zeros(3)], w / "list.pth")
    torch.save({"classifier.6.weight": 3}, w / "not_tensors.pth")
    torch.save(argparse_namespace(), w / "pickled_object.pth")  # refused by weights_only loading
    with torch.device("meta"):
        vgg11_shapes = {k: tuple(v.shape) for k, v in vgg11(weights=None).state_dict().items()}
    torch.save(_zeros_like_shapes(vgg11_shapes), w / "vgg11.pth")
    shapes = _vgg16_shapes()
    torch.save({k: torch.zeros(1) for k in shapes}, w / "vgg16_wrong_shapes.pth")
    torch.save(_zeros_like_shapes(shapes, float("nan")), w / "vgg16_nan.pth")
    (w / "a_dir.pth").mkdir()
    p["weights"] = w

    # DeepSpeed config files.
    (base / "ds_invalid.json").write_text("{'stage': 2,}")
    (base / "ds_list.json").write_text("[1, 2]")
    (base / "ds_zero_list.json").write_text(json.dumps({"zero_optimization": [2]}))
    (base / "ds_stage_7.json").write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    return p


def argparse_namespace() -> object:
    import argparse

    return argparse.Namespace(lr=0.1)


# ---------------------------------------------------------------- the runner
def _main(recipe: str) -> Callable[[list[str]], int]:
    if recipe == "cifar10":
        from recipes.cifar10 import main
    elif recipe == "dogcat":
        from recipes.dogcat import main
    else:
        from recipes.make_data import main
    return main


def base_args(recipe: str, p: dict[str, Path], out: Path) -> list[str]:
    if recipe == "make_data":
        return []
    data = p["cifar"] if recipe == "cifar10" else p["dogcat"]
    extra = ["--image-size", "32"] if recipe == "dogcat" else []
    # Later options win in argparse: each case appends what it gets wrong.
    return [
        "--backend",
        "single",
        "--device",
        "cpu",
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--epochs",
        "1",
        "--num-workers",
        "0",
        "--batch-size",
        "4",
        *extra,
    ]


def expect_clean_error(stderr: str, code: object, *needles: str) -> str:
    """Exit status 2, no traceback, exactly one ``error: ...`` line, holding every needle."""
    assert code == 2, f"exit status {code!r}, expected 2; stderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one 'error: ...' line:\n{stderr[-3000:]}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def run_in_process(capsys, recipe: str, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        _main(recipe)(argv)
        pytest.fail(f"{recipe} {' '.join(argv)} did not fail")  # pragma: no cover
    return expect_clean_error(capsys.readouterr().err, exited.value.code, *needles)


# ------------------------------------------------------------- the catalogue
# (id, recipe, extra args with {name} standing for inputs[name], what the message must say)
OPTIONS = [
    ("epochs-0", "cifar10", ["--epochs", "0"], ["--epochs", "integer >= 1, got 0"]),
    ("epochs-negative", "cifar10", ["--epochs=-3"], ["--epochs", ">= 1"]),
    ("epochs-fraction", "cifar10", ["--epochs", "1.5"], ["--epochs", "expected an integer, got '1.5'"]),
    ("epochs-word", "cifar10", ["--epochs", "ten"], ["--epochs", "expected an integer"]),
    ("batch-size-0", "cifar10", ["--batch-size", "0"], ["--batch-size", ">= 1"]),
    ("batch-size-negative", "dogcat", ["--batch-size=-8"], ["--batch-size", ">= 1"]),
    ("max-steps-0", "cifar10", ["--max-steps", "0"], ["--max-steps", ">= 1"]),
    ("num-workers-negative", "cifar10", ["--num-workers=-1"], ["--num-workers", ">= 0"]),
    ("lr-0", "cifar10", ["--lr", "0"], ["--lr", "finite number > 0"]),
    ("lr-negative", "cifar10", ["--lr=-0.1"], ["--lr", "finite number > 0"]),
    ("lr-nan", "cifar10", ["--lr", "nan"], ["--lr", "finite number > 0, got nan"]),
    ("lr-inf", "dogcat", ["--lr", "inf"], ["--lr", "finite number > 0"]),
    ("lr-overflow", "cifar10", ["--lr", "1e999"], ["--lr", "finite number > 0"]),
    ("lr-word", "cifar10", ["--lr", "fast"], ["--lr", "expected a number"]),
    ("momentum-negative", "cifar10", ["--momentum=-0.5"], ["--momentum", "[0, 1)"]),
    ("momentum-nan", "cifar10", ["--momentum", "nan"], ["--momentum", "[0, 1)"]),
    ("momentum-1.5", "dogcat", ["--momentum", "1.5"], ["--momentum", "[0, 1)"]),
    ("seed-negative", "cifar10", ["--seed=-1"], ["--seed", "[0, 4294967295]"]),
    ("seed-huge", "cifar10", ["--seed", str(2**64)], ["--seed", "[0, 4294967295]"]),
    ("timeout-0", "cifar10", ["--timeout", "0"], ["--timeout"]),
    ("backend-unknown", "cifar10", ["--backend", "mpi"], ["--backend", "invalid choice"]),
    ("device-unknown", "cifar10", ["--device", "tpu"], ["--device", "invalid choice"]),
    ("option-unknown", "cifar10", ["--learning-rate", "0.1"], ["unrecognized arguments"]),
    ("val-fraction-0", "dogcat", ["--val-fraction", "0"], ["--val-fraction", "strictly between 0 and 1"]),
    ("val-fraction-1", "dogcat", ["--val-fraction", "1"], ["--val-fraction", "strictly between 0 and 1"]),
    ("val-fraction-negative", "dogcat", ["--val-fraction=-0.2"], ["--val-fraction"]),
    ("val-fraction-nan", "dogcat", ["--val-fraction", "nan"], ["--val-fraction"]),
    ("image-size-16", "dogcat", ["--image-size", "16"], ["--image-size", "too small for VGG16", "at least 32"]),
    ("image-size-0", "dogcat", ["--image-size", "0"], ["--image-size", "too small for VGG16"]),
    ("image-size-huge", "dogcat", ["--image-size", "100000"], ["--image-size", "too large", "at most 4096"]),
    ("image-size-word", "dogcat", ["--image-size", "big"], ["--image-size", "expected an integer"]),
    (
        "weights-and-pretrained",
        "dogcat",
        ["--pretrained", "--weights", "{weights}/lenet.pth"],
        ["either --pretrained or --weights"],
    ),
    ("zero-stage-9", "cifar10", ["--backend", "deepspeed", "--zero-stage", "9"], ["--zero-stage", "invalid choice"]),
]
PATHS = [
    ("num-workers-huge", "cifar10", ["--num-workers", "100000"], ["--num-workers 100000", "use at most"]),
    ("out-dir-is-file", "cifar10", ["--out-dir", "{file}"], ["--out-dir", "is a file"]),
    ("out-dir-under-file", "cifar10", ["--out-dir", "{under_file}"], ["cannot be created", "is a file"]),
    ("out-dir-deep-under-file", "dogcat", ["--out-dir", "{under_file}/a/b"], ["cannot be created", "is a file"]),
    # /proc refuses new files even to root, for whom os.access always says yes.
    ("out-dir-not-writable", "cifar10", ["--out-dir", "/proc/parallelx-out"], ["--out-dir", "not writable"]),
    ("out-dir-dangling-link", "cifar10", ["--out-dir", "{dangling}"], ["broken symbolic link"]),
    ("data-dir-is-file-cifar", "cifar10", ["--data-dir", "{file}"], ["--data-dir", "is a file"]),
    ("data-dir-is-file-dogcat", "dogcat", ["--data-dir", "{file}"], ["--data-dir", "is a file"]),
    ("data-dir-missing-cifar", "cifar10", ["--data-dir", "{missing}"], ["no CIFAR-10 data", "make_data"]),
    ("data-dir-missing-dogcat", "dogcat", ["--data-dir", "{missing}"], ["does not exist", "make_data"]),
    ("data-dir-empty-cifar", "cifar10", ["--data-dir", "{empty_dir}"], ["no CIFAR-10 data"]),
    ("data-dir-empty-dogcat", "dogcat", ["--data-dir", "{empty_dir}"], ["no images found"]),
    ("weights-missing", "dogcat", ["--weights", "{weights}/nope.pth"], ["--weights", "no such file"]),
    ("weights-directory", "dogcat", ["--weights", "{weights}/a_dir.pth"], ["--weights", "is a directory"]),
    ("weights-garbage", "dogcat", ["--weights", "{weights}/garbage.pth"], ["not a readable PyTorch file"]),
    ("weights-empty", "dogcat", ["--weights", "{weights}/empty.pth"], ["--weights", "is empty"]),
    ("weights-truncated", "dogcat", ["--weights", "{weights}/truncated.pth"], ["not a readable PyTorch file"]),
    (
        "weights-pickled-object",
        "dogcat",
        ["--weights", "{weights}/pickled_object.pth"],
        ["not a readable PyTorch file"],
    ),
    ("weights-a-tensor", "dogcat", ["--weights", "{weights}/tensor.pth"], ["holds a Tensor, not a state dict"]),
    ("weights-a-list", "dogcat", ["--weights", "{weights}/list.pth"], ["holds a list, not a state dict"]),
    ("weights-not-tensors", "dogcat", ["--weights", "{weights}/not_tensors.pth"], ["not a state dict"]),
    ("weights-lenet", "dogcat", ["--weights", "{weights}/lenet.pth"], ["not a VGG16 state dict"]),
    ("weights-vgg11", "dogcat", ["--weights", "{weights}/vgg11.pth"], ["not a VGG16 state dict", "missing"]),
    (
        "weights-wrong-shapes",
        "dogcat",
        ["--weights", "{weights}/vgg16_wrong_shapes.pth"],
        ["does not fit VGG16", "features.0.weight"],
    ),
    ("weights-nan", "dogcat", ["--weights", "{weights}/vgg16_nan.pth"], ["nan or inf"]),
    (
        "ds-config-missing",
        "cifar10",
        ["--backend", "deepspeed", "--deepspeed-config", "{base}/nope.json"],
        ["does not exist"],
    ),
    (
        "ds-config-invalid-json",
        "cifar10",
        ["--backend", "deepspeed", "--deepspeed-config", "{base}/ds_invalid.json"],
        ["not valid JSON"],
    ),
    (
        "ds-config-not-object",
        "dogcat",
        ["--backend", "deepspeed", "--deepspeed-config", "{base}/ds_list.json"],
        ["must hold a JSON object"],
    ),
    (
        "ds-config-zero-not-object",
        "cifar10",
        ["--backend", "deepspeed", "--deepspeed-config", "{base}/ds_zero_list.json"],
        ["zero_optimization"],
    ),
    (
        "ds-config-stage-7",
        "cifar10",
        ["--backend", "deepspeed", "--deepspeed-config", "{base}/ds_stage_7.json"],
        ["stage must be 0, 1, 2 or 3"],
    ),
]
CIFAR_DATA = [
    ("cifar-missing-batch", "{cifar_no_batch3}", ["missing data_batch_3"]),
    ("cifar-missing-meta", "{cifar_no_meta}", ["missing batches.meta"]),
    ("cifar-batch-is-directory", "{cifar_batch_is_dir}", ["missing data_batch_4"]),
    ("cifar-folder-is-file", "{cifar_folder_is_file}", ["no CIFAR-10 data"]),
    ("cifar-garbage-batch", "{cifar_garbage}", ["data_batch_1 is not a readable CIFAR-10 batch"]),
    ("cifar-truncated-batch", "{cifar_truncated}", ["data_batch_2 is not a readable CIFAR-10 batch"]),
    ("cifar-empty-batch-file", "{cifar_empty_file}", ["test_batch is not a readable CIFAR-10 batch"]),
    ("cifar-text-batch", "{cifar_text_file}", ["data_batch_1 is not a readable CIFAR-10 batch"]),
    ("cifar-batch-not-dict", "{cifar_a_list}", ["expected a dict with 'data' and 'labels'", "list"]),
    ("cifar-batch-no-labels", "{cifar_no_labels}", ["expected a dict with 'data' and 'labels'", "keys data"]),
    ("cifar-rows-of-1024", "{cifar_narrow_rows}", ["shape (4, 1024)", "N x 3072"]),
    ("cifar-4d-data", "{cifar_hwc_4d}", ["shape (4, 32, 32, 3)", "N x 3072"]),
    ("cifar-float-data", "{cifar_float_data}", ["float32 array", "uint8"]),
    ("cifar-list-data", "{cifar_list_data}", ["'data' is list"]),
    ("cifar-labels-short", "{cifar_few_labels}", ["4 images but 'labels' has shape (3,)"]),
    ("cifar-label-12", "{cifar_label_12}", ["outside 0..9", "12"]),
    ("cifar-label-negative", "{cifar_label_neg}", ["outside 0..9", "-1"]),
    ("cifar-label-strings", "{cifar_label_str}", ["labels must be integers"]),
    ("cifar-label-floats", "{cifar_label_float}", ["labels must be integers"]),
    ("cifar-meta-garbage", "{cifar_meta_garbage}", ["batches.meta is not a readable CIFAR-10 meta file"]),
    ("cifar-meta-3-classes", "{cifar_meta_3_names}", ["label_names"]),
]
DOGCAT_DATA = [
    ("csv-empty", "{dogcat_csv_empty}", ["train.csv is empty"]),
    ("csv-header-only", "{dogcat_csv_header_only}", ["lists no images"]),
    ("csv-wrong-columns", "{dogcat_csv_columns}", ["expected the columns 'filename,label'", "file,class"]),
    ("csv-label-2", "{dogcat_csv_label_2}", ["line 3", "label '2'", "not 0/1 or cat/dog"]),
    ("csv-label-word", "{dogcat_csv_label_bird}", ["label 'bird'", "not 0/1 or cat/dog"]),
    ("csv-label-0.5", "{dogcat_csv_label_half}", ["label '0.5'", "not 0/1 or cat/dog"]),
    ("csv-label-blank", "{dogcat_csv_label_blank}", ["label ''", "not 0/1 or cat/dog"]),
    ("csv-duplicate", "{dogcat_csv_duplicate}", ["more than once", "cat.0.jpg", "lines 2, 4"]),
    ("csv-missing-file", "{dogcat_csv_missing_file}", ["missing from", "cat.77.jpg"]),
    ("csv-outside-folder", "{dogcat_csv_outside}", ["not a path inside"]),
    ("csv-absolute-path", "{dogcat_csv_absolute}", ["not a path inside"]),
    ("csv-blank-filename", "{dogcat_csv_blank_name}", ["line 3", "filename is empty"]),
    ("csv-ragged", "{dogcat_csv_ragged}", ["not a readable CSV", "line 2 has 4 field(s)"]),
    ("csv-binary", "{dogcat_csv_binary}", ["train.csv"]),
    ("csv-is-directory", "{dogcat_csv_is_dir}", ["train.csv is not a file"]),
    ("one-image-no-split", "{dogcat_one_image}", ["leaves no image to train on"]),
    ("all-images-unreadable", "{dogcat_all_unreadable}", ["none of the 6 image files", "is readable"]),
]
CATALOGUE = (
    [pytest.param(r, a, n, id=i) for i, r, a, n in OPTIONS + PATHS]
    + [pytest.param("cifar10", ["--data-dir", d], n, id=i) for i, d, n in CIFAR_DATA]
    + [pytest.param("dogcat", ["--data-dir", d], n, id=i) for i, d, n in DOGCAT_DATA]
    + [
        pytest.param(
            "dogcat",
            ["--data-dir", "{dogcat}", "--val-fraction", "0.95"],
            ["lower --val-fraction"],
            id="val-fraction-leaves-train-empty",
        ),
        pytest.param("make_data", ["cifar10", "--out", "{file}"], ["--out", "is a file"], id="make-data-out-file"),
        pytest.param(
            "make_data",
            ["dogcat", "--out", "{under_file}"],
            ["--out", "cannot be created"],
            id="make-data-out-under-file",
        ),
        pytest.param(
            "make_data", ["cifar10", "--out", "{base}/x", "--train", "3"], ["--train", ">= 5"], id="make-data-train-3"
        ),
        pytest.param(
            "make_data",
            ["dogcat", "--out", "{base}/x", "--per-class", "0"],
            ["--per-class", ">= 1"],
            id="make-data-per-class-0",
        ),
        pytest.param(
            "make_data", ["dogcat", "--out", "{base}/x", "--seed=-4"], ["--seed"], id="make-data-seed-negative"
        ),
    ]
)


@pytest.mark.parametrize(("recipe", "extra", "needles"), CATALOGUE)
def test_bad_input_fails_before_training(recipe, extra, needles, inputs, tmp_path, capsys):
    argv = base_args(recipe, inputs, tmp_path / "out") + [a.format(**inputs) for a in extra]
    run_in_process(capsys, recipe, argv, *needles)
    assert not (tmp_path / "out").exists(), "nothing is written before the inputs are checked"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is valid here")
def test_device_cuda_without_gpu(inputs, tmp_path, capsys):
    run_in_process(
        capsys, "cifar10", base_args("cifar10", inputs, tmp_path / "out") + ["--device", "cuda"], "cuda", "--device cpu"
    )


def test_divergence_stops_training_with_an_error(inputs, tmp_path, capsys):
    # Inputs valid, learning rate absurd: the loss goes to inf/nan in the first
    # epoch and the run stops with a message instead of writing nan metrics.
    argv = base_args("cifar10", inputs, tmp_path / "out") + ["--lr", "1e30", "--epochs", "3"]
    run_in_process(capsys, "cifar10", argv, "the training loss is", "lower --lr")


def test_image_passing_the_header_check_but_not_decoding_is_skipped(inputs, tmp_path, capsys):
    from PIL import Image

    from recipes.data import is_decodable_image, scan_dogcat

    data = tmp_path / "data"
    shutil.copytree(inputs["dogcat"], data)
    good = (data / "train" / "dog.0.jpg").read_bytes()
    # Headers up to the start of the image data, then the end marker: PIL
    # identifies the file (size, mode), but decoding fails.
    no_data = good[: good.index(b"\xff\xda")] + b"\xff\xd9"
    (data / "train" / "dog.50.jpg").write_bytes(no_data)
    with Image.open(data / "train" / "dog.50.jpg") as img:
        assert img.format == "JPEG" and img.size[0] > 0  # passes a header check
    assert not is_decodable_image(data / "train" / "dog.50.jpg")
    (data / "train" / "cat.50.jpg").write_bytes(good[: len(good) * 2 // 3])  # truncated download
    (data / "train" / "cat.51.png").write_bytes(b"\x89PNG\r\n\x1a\n" + garbage(200))
    capsys.readouterr()
    files, labels = scan_dogcat(data)
    err = capsys.readouterr().err
    assert "skipped 3 unreadable image file(s)" in err and "dog.50.jpg" in err and "cat.51.png" in err
    assert len(files) == len(labels) == 6
    assert not {f.name for f in files} & {"dog.50.jpg", "cat.50.jpg", "cat.51.png"}


def test_files_named_neither_cat_nor_dog_are_counted_once(inputs, tmp_path, capsys):
    from recipes.data import list_dogcat, scan_dogcat

    data = tmp_path / "data"
    shutil.copytree(inputs["dogcat"], data)
    shutil.copy(data / "train" / "cat.0.jpg", data / "train" / "bird.0.jpg")
    capsys.readouterr()
    assert len(list_dogcat(data)[0]) == 6  # the check before init: silent
    assert capsys.readouterr().err == ""
    assert len(scan_dogcat(data)[0]) == 6
    assert "ignored 1 image file(s)" in capsys.readouterr().err


def test_csv_labels_and_names_are_parsed_strictly(inputs, tmp_path):
    from recipes.data import list_dogcat

    data = tmp_path / "data"
    shutil.copytree(inputs["dogcat"], data)
    # Case, spaces around values and a header with spaces are tolerated; 0/1 and cat/dog both work.
    (data / "train.csv").write_text("filename, label\n cat.0.jpg , CAT\ndog.0.jpg,1\ncat.1.jpg, 0\n")
    files, labels = list_dogcat(data)
    assert [f.name for f in files] == ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg"] and labels == [0, 0, 1]


def test_weights_saved_from_a_wrapped_model_load(tmp_path):
    from recipes.models import _vgg16_shapes, check_vgg16_state

    shapes = _vgg16_shapes()
    state = {f"module.{k}": v for k, v in _zeros_like_shapes(shapes).items()}
    checked = check_vgg16_state(state, "test")
    assert set(checked) == set(shapes)
    # A 3-class head of the right width is accepted too: it is replaced.
    three = {
        **_zeros_like_shapes(shapes),
        "classifier.6.weight": torch.zeros(3, 4096),
        "classifier.6.bias": torch.zeros(3),
    }
    assert check_vgg16_state({"model": three}, "test")["classifier.6.bias"].shape == (3,)


# ------------------------------------------------------ end to end, as users run it
def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=100)


def test_end_to_end_option_error_is_one_line():
    proc = run([sys.executable, "-m", "recipes.cifar10", "--backend", "single", "--data-dir", "x", "--lr", "nan"])
    expect_clean_error(proc.stderr, proc.returncode, "--lr", "finite number > 0")
    assert proc.stderr.strip().count("\n") == 0, "one line, no usage block"


@pytest.mark.scenario  # a recipe's process of its own (a minute beside make test's launches)
def test_end_to_end_data_error_after_backend_init(inputs, tmp_path):
    # Fails in the data loader, inside `with backend:`: released, one line, status 2.
    proc = run(
        [
            sys.executable,
            "-m",
            "recipes.cifar10",
            "--backend",
            "single",
            "--data-dir",
            str(inputs["cifar_label_12"]),
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    expect_clean_error(proc.stderr, proc.returncode, "outside 0..9")
    assert not (tmp_path / "out").exists()


@pytest.mark.scenario  # a recipe's process of its own (a minute beside make test's launches)
def test_run_as_a_file_from_elsewhere(inputs, tmp_path):
    # As the deepspeed launcher runs a recipe: a file path, from any directory.
    proc = run(
        [
            sys.executable,
            str(ROOT / "recipes" / "dogcat.py"),
            "--backend",
            "single",
            "--data-dir",
            str(inputs["dogcat"]),
            "--image-size",
            "32",
            "--weights",
            str(inputs["weights"] / "garbage.pth"),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
    )
    expect_clean_error(proc.stderr, proc.returncode, "not a readable PyTorch file")


@pytest.mark.scenario  # a recipe's process of its own (a minute beside make test's launches)
def test_installed_package_name(inputs, tmp_path):
    import importlib.util

    if importlib.util.find_spec("parallelx.recipes") is None:
        pytest.skip("parallelx is not installed (pip install -e .): parallelx.recipes is not importable")
    proc = run(
        [sys.executable, "-m", "parallelx.recipes.make_data", "dogcat", "--out", str(inputs["under_file"])],
        cwd=tmp_path,
    )
    expect_clean_error(proc.stderr, proc.returncode, "--out", "cannot be created")


@pytest.mark.launcher
@pytest.mark.scenario
@pytest.mark.timeout(200)
def test_data_error_under_torchrun_stops_every_rank(inputs, tmp_path):
    # Both ranks join the process group, then fail in the data loader: each
    # releases the group on its way out (`with backend:`), none waits for the
    # other in a collective, and the job ends at once.
    from launching import launch, require_launcher

    require_launcher("torchrun")
    res = launch(
        "torchrun",
        [
            "-m",
            "recipes.cifar10",
            "--backend",
            "ddp",
            "--data-dir",
            str(inputs["cifar_label_12"]),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        timeout=150,
    )
    assert res.returncode != 0, res.tail()
    assert res.output.count("error: ") >= 2 and "outside 0..9" in res.output, res.tail()
    assert res.seconds < 90, f"the job took {res.seconds:.0f}s to stop"
    assert not (tmp_path / "out").exists()
