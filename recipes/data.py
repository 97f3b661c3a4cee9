"""Datasets of the recipes: CIFAR-10 (torchvision's loader) and Kaggle
Dogs-vs-Cats (a folder of JPEGs, optionally with a ``train.csv``).

Both fail with a clear :class:`ParallelxError` on a missing, empty or
malformed data directory.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision import transforms
from torchvision.datasets import CIFAR10

from parallelx.errors import ParallelxError

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: Written by ``recipes.make_data`` beside generated data, which cannot match
#: the official CIFAR-10 md5 sums.
GENERATED_MARKER = "GENERATED_BY_PARALLELX"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
DOGCAT_CLASSES = ("cat", "dog")


def _warn(msg: str, verbose: bool) -> None:
    # Every rank builds the dataset; the recipes pass verbose=backend.is_main().
    if verbose:
        print(f"warning: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ CIFAR-10
class _UncheckedCIFAR10(CIFAR10):
    """torchvision's CIFAR10 reader without the md5 check of the official files."""

    def _check_integrity(self) -> bool:
        return True

    def _load_meta(self) -> None:
        # torchvision checks batches.meta's md5 here too; read it the same way without.
        with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
            meta = pickle.load(f, encoding="latin1")
        self.classes = meta[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


def cifar10_root(data_dir: str | Path) -> Path:
    """torchvision's ``root``: the folder that contains ``cifar-10-batches-py``.
    ``data_dir`` may be that folder or ``cifar-10-batches-py`` itself."""
    d = Path(data_dir)
    return d.parent if d.name == CIFAR_DIR else d


def load_cifar10(data_dir: str | Path, *, download: bool = False, skip_checksum: bool = False,
                 verbose: bool = True) -> tuple[Dataset, Dataset]:
    """(train, test) CIFAR-10 datasets, normalized, with a random flip for training.

    With ``download`` torchvision fetches the official archive (where the
    network allows).  Otherwise the files must exist; their md5 sums are
    checked against the official release unless the folder was written by
    ``recipes.make_data`` (it carries a marker file) or ``skip_checksum``.
    """
    root = cifar10_root(data_dir)
    folder = root / CIFAR_DIR
    train_tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    if download:
        try:
            return (CIFAR10(str(root), train=True, download=True, transform=train_tf),
                    CIFAR10(str(root), train=False, download=True, transform=test_tf))
        except Exception as exc:
            raise ParallelxError(f"downloading CIFAR-10 into {root} failed ({type(exc).__name__}: {exc}); "
                                 "fetch cifar-10-python.tar.gz elsewhere, unpack it there and drop --download"
                                 ) from None
    if not folder.is_dir():
        raise ParallelxError(f"no CIFAR-10 data at {folder}: pass --data-dir pointing at a '{CIFAR_DIR}' folder, "
                             "add --download, or generate a stand-in with "
                             "`python -m recipes.make_data cifar10 --out DIR`")
    expected = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    missing = [f for f in expected if not (folder / f).is_file()]
    if missing:
        raise ParallelxError(f"{folder} is not a complete CIFAR-10 folder: missing {', '.join(missing)}")
    generated = (folder / GENERATED_MARKER).exists()
    cls: type[CIFAR10] = CIFAR10
    if generated or skip_checksum:
        _warn(f"{folder}: md5 check skipped ({'generated data' if generated else '--skip-checksum'}); "
              "these are not the official CIFAR-10 files", verbose)
        cls = _UncheckedCIFAR10
    try:
        return (cls(str(root), train=True, download=False, transform=train_tf),
                cls(str(root), train=False, download=False, transform=test_tf))
    except RuntimeError as exc:
        if "corrupted" in str(exc):
            raise ParallelxError(f"{folder}: the files do not match the official CIFAR-10 md5 sums; "
                                 "re-download with --download, or pass --skip-checksum to read them anyway") from None
        raise ParallelxError(f"{folder}: cannot read CIFAR-10 ({exc})") from None
    except Exception as exc:  # unpickling errors, wrong shapes
        raise ParallelxError(f"{folder}: cannot read CIFAR-10 ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------- Dogs vs Cats
def _image_dir(data_dir: Path) -> Path:
    """Kaggle's layout is ``DIR/train/cat.0.jpg``; accept ``DIR/train`` too."""
    if not data_dir.is_dir():
        raise ParallelxError(f"data directory {data_dir} does not exist; generate one with "
                             "`python -m recipes.make_data dogcat --out DIR`")
    return data_dir / "train" if (data_dir / "train").is_dir() else data_dir


def _label_from_name(name: str) -> int | None:
    prefix = name.split(".", 1)[0].lower()
    return DOGCAT_CLASSES.index(prefix) if prefix in DOGCAT_CLASSES else None


def _is_readable_image(path: Path) -> bool:
    """Cheap check, done once per file: PIL recognises the header, and a JPEG
    ends with its end-of-image marker (a truncated download does not)."""
    try:
        with Image.open(path) as img:
            fmt = img.format
    except Exception:
        return False
    if fmt == "JPEG":
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64))
            return b"\xff\xd9" in f.read()
    return True


def scan_dogcat(data_dir: str | Path, *, verbose: bool = True) -> tuple[list[Path], list[int]]:
    """Image files and labels (0 = cat, 1 = dog), sorted by file name.

    Labels come from ``DIR/train.csv`` (columns ``filename,label``; label 0/1 or
    cat/dog) when present, else from the file names.  Files that are not
    readable images (wrong format, truncated JPEG) are skipped with one
    warning that counts them.
    """
    root = Path(data_dir)
    images = _image_dir(root)
    csv = root / "train.csv"
    if csv.is_file():
        try:
            table = pd.read_csv(csv)
        except Exception as exc:
            raise ParallelxError(f"{csv}: not a readable CSV ({exc})") from None
        if list(table.columns) != ["filename", "label"]:
            found = ",".join(map(str, table.columns))
            raise ParallelxError(f"{csv}: expected the columns 'filename,label', found {found}")
        pairs = []
        for name, label in zip(table["filename"].astype(str), table["label"]):
            lab = DOGCAT_CLASSES.index(label) if label in DOGCAT_CLASSES else label
            try:
                lab = int(lab)
            except (TypeError, ValueError):
                lab = -1
            if lab not in (0, 1):
                raise ParallelxError(f"{csv}: label {label!r} for {name} is not 0/1 or cat/dog")
            pairs.append((images / name, lab))
        absent = [p.name for p, _ in pairs if not p.is_file()]
        if absent:
            raise ParallelxError(f"{csv} lists {len(absent)} file(s) missing from {images}, e.g. {absent[0]}")
    else:
        pairs = []
        for p in sorted(images.iterdir()):
            if p.suffix.lower() in IMAGE_SUFFIXES:
                lab = _label_from_name(p.name)
                if lab is not None:
                    pairs.append((p, lab))
    if not pairs:
        raise ParallelxError(f"no images found in {images}: expected Kaggle names like cat.0.jpg and dog.0.jpg "
                             "(or a train.csv with filename,label)")
    good = [(p, lab) for p, lab in sorted(pairs) if _is_readable_image(p)]
    skipped = len(pairs) - len(good)
    if skipped:
        bad = sorted({p.name for p, _ in pairs} - {p.name for p, _ in good})
        _warn(f"skipped {skipped} unreadable image file(s) in {images} (not an image, or truncated): "
              f"{', '.join(bad[:5])}{' ...' if skipped > 5 else ''}", verbose)
    if not good:
        raise ParallelxError(f"none of the {len(pairs)} image files in {images} is readable")
    return [p for p, _ in good], [lab for _, lab in good]


def dogcat_transform(image_size: int, train: bool) -> transforms.Compose:
    steps: list = [transforms.Resize((image_size, image_size))]
    if train:
        steps.append(transforms.RandomHorizontalFlip())
    steps += [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return transforms.Compose(steps)


class DogCatDataset(Dataset):
    """Dogs-vs-Cats images, decoded at reduced size.

    ``Image.draft`` lets the JPEG decoder scale by 1/2, 1/4 or 1/8 while
    decoding, so a 500-pixel photo resized to 64 costs a fraction of a full
    decode: data loading must not be what limits training speed.
    """

    def __init__(self, files: Sequence[Path], labels: Sequence[int], image_size: int, train: bool) -> None:
        if len(files) != len(labels):
            raise ParallelxError("files and labels differ in length")
        self.files, self.labels = list(files), list(labels)
        self.image_size = image_size
        self.transform = dogcat_transform(image_size, train)

    def __len__(self) -> int:
        return len(self.files)

    def load_image(self, index: int) -> Image.Image:
        path = self.files[index]
        try:
            with Image.open(path) as img:
                img.draft("RGB", (self.image_size, self.image_size))
                return img.convert("RGB")
        except Exception as exc:
            raise ParallelxError(f"cannot decode {path}: {exc}") from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.load_image(index)), self.labels[index]


def split_indices(n: int, val_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """A fixed-seed random split: (train indices, val indices)."""
    if not 0 < val_fraction < 1:
        raise ParallelxError(f"val fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ParallelxError(f"{n} images are too few to split into train and val")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def load_dogcat(data_dir: str | Path, image_size: int, *, val_fraction: float = 0.2,
                seed: int = 0, verbose: bool = True) -> tuple[Dataset, Dataset]:
    """(train, val) Dogs-vs-Cats datasets: an 80/20 split with a fixed seed."""
    files, labels = scan_dogcat(data_dir, verbose=verbose)
    train_idx, val_idx = split_indices(len(files), val_fraction, seed)
    return (Subset(DogCatDataset(files, labels, image_size, train=True), train_idx),
            Subset(DogCatDataset(files, labels, image_size, train=False), val_idx))
