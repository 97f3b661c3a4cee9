"""Datasets of the recipes: CIFAR-10 (the official Python pickles), Kaggle
Dogs-vs-Cats (a folder of JPEGs, optionally with a ``train.csv``) and a text
file of characters; and the data loaders the recipes draw from
(:func:`make_loader`).

Everything a training run will read is checked here, before training starts:
a missing, empty or malformed data directory, a damaged or malformed
CIFAR-10 batch (shapes, labels outside 0..9), a bad ``train.csv``, all fail
with one :class:`ParallelxError` that names the file and says what was
expected.  Image files that cannot be decoded are skipped, with one warning
that counts them.
"""

from __future__ import annotations

import csv
import os
import pickle
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import transforms

from parallelx import warn
from parallelx.errors import ParallelxError
from parallelx.utils import threads_per_process

if TYPE_CHECKING:
    from parallelx import Backend, ShardedSampler

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILES = ("test_batch",)
CIFAR_META_FILE = "batches.meta"
CIFAR_NUM_CLASSES = 10
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: Written by ``make_data`` beside generated data, which cannot match the
#: official CIFAR-10 md5 sums.
GENERATED_MARKER = "GENERATED_BY_PARALLELX"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
#: The text file of the GPT recipe's ``--data-dir`` (nanoGPT's name for it).
TEXT_FILE = "input.txt"
DOGCAT_CLASSES = ("cat", "dog")
#: The command that writes stand-in data, as this package is named here
#: (``recipes`` in a checkout, ``parallelx.recipes`` when installed).
MAKE_DATA = f"python -m {__package__ or 'recipes'}.make_data"


def _brief(exc: BaseException) -> str:
    """``Type: first line of the message``: enough to tell damage apart, one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ------------------------------------------------------------------ CIFAR-10
class CIFAR10Arrays(Dataset):
    """CIFAR-10 held in memory as torchvision's ``CIFAR10`` holds it:
    ``data`` is N x 32 x 32 x 3 uint8 (HWC), ``targets`` the labels 0..9."""

    def __init__(self, data: np.ndarray, targets: list[int], classes: list[str], transform: Any) -> None:
        self.data, self.targets, self.classes = data, targets, classes
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def cifar10_root(data_dir: str | Path) -> Path:
    """The folder that contains ``cifar-10-batches-py`` (torchvision's ``root``).
    ``data_dir`` may be that folder or ``cifar-10-batches-py`` itself."""
    d = Path(data_dir)
    return d.parent if d.name == CIFAR_DIR else d


def cifar10_folder(data_dir: str | Path, *, download: bool = False) -> Path:
    """The ``cifar-10-batches-py`` folder for ``data_dir``, checked to hold
    every file of the official layout (without reading them: cheap enough
    to run before a process group is joined).  With ``download`` the files
    may be missing: they are fetched."""
    d = Path(data_dir)
    if d.exists() and not d.is_dir():
        raise ParallelxError(
            f"--data-dir {d} is a file; expected a directory holding '{CIFAR_DIR}' (or that folder itself)"
        )
    folder = cifar10_root(d) / CIFAR_DIR
    if download:
        if folder.exists() and not folder.is_dir():
            raise ParallelxError(f"{folder} is a file; CIFAR-10 is unpacked into a folder of that name: remove it")
        return folder
    if not folder.is_dir():
        raise ParallelxError(
            f"no CIFAR-10 data at {folder}: pass --data-dir pointing at a '{CIFAR_DIR}' folder, "
            f"add --download, or generate a stand-in with `{MAKE_DATA} cifar10 --out DIR`"
        )
    expected = [*CIFAR_TRAIN_FILES, *CIFAR_TEST_FILES, CIFAR_META_FILE]
    missing = [f for f in expected if not (folder / f).is_file()]
    if missing:
        raise ParallelxError(
            f"{folder} is not a complete CIFAR-10 folder: missing {', '.join(missing)} "
            f"(expected {', '.join(expected)}); unpack cifar-10-python.tar.gz again, or add "
            "--download"
        )
    return folder


def _unpickle(path: Path, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            # The official files are Python 2 pickles: latin1 reads their byte strings.
            return pickle.load(f, encoding="latin1")
    except Exception as exc:  # truncated (EOFError), garbage (UnpicklingError, ValueError, ...)
        raise ParallelxError(
            f"{path} is not a readable {what} ({_brief(exc)}): the file is damaged or truncated; "
            "unpack cifar-10-python.tar.gz again (or --download, or regenerate it with "
            f"`{MAKE_DATA} cifar10`)"
        ) from None


def read_cifar10_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    """One batch file: images as N x 32 x 32 x 3 uint8 and labels 0..9,
    checked against the official layout (a dict with ``data``, N rows of
    3072 bytes, R then G then B planes, and ``labels``, N integers)."""
    entry = _unpickle(path, "CIFAR-10 batch")
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        found = f"keys {', '.join(sorted(map(str, entry)))}" if isinstance(entry, dict) else type(entry).__name__
        raise ParallelxError(
            f"{path}: expected a dict with 'data' and 'labels' as in the official CIFAR-10 "
            f"batches, found {found or 'an empty dict'}"
        )
    data, labels = entry["data"], entry["labels"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
        found = f"a {data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ParallelxError(
            f"{path}: 'data' is {found}; expected uint8 rows of 3072 values (N x 3072: "
            "32 x 32 pixels, the R, G then B planes)"
        )
    try:
        y = np.asarray(labels)
    except ValueError as exc:  # a ragged nested list
        raise ParallelxError(f"{path}: 'labels' is not a list of integers ({_brief(exc)})") from None
    if y.ndim != 1 or len(y) != len(data):
        raise ParallelxError(
            f"{path}: {len(data)} images but 'labels' has shape {y.shape}; expected one label per image"
        )
    if len(y) and not np.issubdtype(y.dtype, np.integer):
        first = y[0].item()
        raise ParallelxError(
            f"{path}: labels must be integers 0..{CIFAR_NUM_CLASSES - 1}, found "
            f"{type(first).__name__} values such as {first!r}"
        )
    bad = np.flatnonzero((y < 0) | (y >= CIFAR_NUM_CLASSES))
    if len(bad):
        raise ParallelxError(
            f"{path}: {len(bad)} label(s) outside 0..{CIFAR_NUM_CLASSES - 1} (CIFAR-10 has "
            f"{CIFAR_NUM_CLASSES} classes), e.g. {int(y[bad[0]])} for image {int(bad[0])}"
        )
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), [int(v) for v in y]


def _read_cifar10_meta(folder: Path) -> list[str]:
    path = folder / CIFAR_META_FILE
    meta = _unpickle(path, "CIFAR-10 meta file")
    names = meta.get("label_names") if isinstance(meta, dict) else None
    if not (isinstance(names, list) and len(names) == CIFAR_NUM_CLASSES and all(isinstance(n, str) for n in names)):
        raise ParallelxError(
            f"{path}: expected a dict whose 'label_names' lists the {CIFAR_NUM_CLASSES} class "
            "names, as in the official release"
        )
    return names


def _read_cifar10_split(folder: Path, files: Sequence[str], classes: list[str], transform: Any) -> CIFAR10Arrays:
    batches = [read_cifar10_batch(folder / f) for f in files]
    data = np.concatenate([images for images, _ in batches])
    targets = [label for _, labels in batches for label in labels]
    if not targets:
        raise ParallelxError(f"{folder}: {', '.join(files)} hold no images")
    return CIFAR10Arrays(data, targets, classes, transform)


def _check_cifar10_md5(folder: Path) -> None:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    official = dict(CIFAR10.train_list + CIFAR10.test_list + [[CIFAR10.meta["filename"], CIFAR10.meta["md5"]]])
    try:
        wrong = [name for name, md5 in official.items() if not check_integrity(str(folder / name), md5)]
    except OSError as exc:
        raise ParallelxError(f"{folder}: cannot read {exc.filename} ({exc.strerror or exc})") from None
    if wrong:
        raise ParallelxError(
            f"{folder}: the files do not match the official CIFAR-10 md5 sums ({', '.join(wrong)}); "
            "re-download with --download, or pass --skip-checksum to read them anyway"
        )


def load_cifar10(
    data_dir: str | Path,
    *,
    download: bool = False,
    skip_checksum: bool = False,
) -> tuple[Dataset, Dataset]:
    """(train, test) CIFAR-10 datasets, normalized, with a random flip for training.

    With ``download`` torchvision fetches the official archive (where the
    network allows).  Otherwise the files must exist; their md5 sums are
    checked against the official release unless the folder was written by
    ``make_data`` (it carries a marker file) or ``skip_checksum``.  Either
    way every batch is checked for the official layout and labels 0..9.
    """
    folder = cifar10_folder(data_dir, download=download)
    if download:
        from torchvision.datasets import CIFAR10

        try:  # downloads, unpacks and checks the md5 sums when a file is missing or damaged
            CIFAR10(str(folder.parent), train=False, download=True)
        except Exception as exc:
            raise ParallelxError(
                f"downloading CIFAR-10 into {folder.parent} failed ({_brief(exc)}); fetch "
                "cifar-10-python.tar.gz elsewhere, unpack it there and drop --download"
            ) from None
    elif (folder / GENERATED_MARKER).exists() or skip_checksum:
        why = "generated data" if (folder / GENERATED_MARKER).exists() else "--skip-checksum"
        warn(f"{folder}: md5 check skipped ({why}); these are not the official CIFAR-10 files")
    else:
        _check_cifar10_md5(folder)
    train_tf = transforms.Compose(
        [transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
    )
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    classes = _read_cifar10_meta(folder)
    return (
        _read_cifar10_split(folder, CIFAR_TRAIN_FILES, classes, train_tf),
        _read_cifar10_split(folder, CIFAR_TEST_FILES, classes, test_tf),
    )


# ------------------------------------------------------------- Dogs vs Cats
def _image_dir(data_dir: Path) -> Path:
    """Kaggle's layout is ``DIR/train/cat.0.jpg``; accept ``DIR/train`` too."""
    if not data_dir.exists():
        raise ParallelxError(
            f"data directory {data_dir} does not exist; generate one with `{MAKE_DATA} dogcat --out DIR`"
        )
    if not data_dir.is_dir():
        raise ParallelxError(
            f"--data-dir {data_dir} is a file; expected the directory that holds Kaggle's "
            "train/ folder (or the images themselves)"
        )
    return data_dir / "train" if (data_dir / "train").is_dir() else data_dir


def _label_from_name(name: str) -> int | None:
    prefix = name.split(".", 1)[0].lower()
    return DOGCAT_CLASSES.index(prefix) if prefix in DOGCAT_CLASSES else None


def _csv_label(text: str) -> int | None:
    """0/1 or cat/dog (any case); None for anything else, including 0.5 and 2."""
    t = text.strip().lower()
    if t in DOGCAT_CLASSES:
        return DOGCAT_CLASSES.index(t)
    return {"0": 0, "1": 1}.get(t)


def _read_csv_listing(csv_path: Path, images: Path) -> list[tuple[Path, int]]:
    if not csv_path.is_file():
        raise ParallelxError(
            f"{csv_path} is not a file; expected a CSV with the columns filename,label (or no "
            "train.csv, to label by file name)"
        )
    how = "expected a header line 'filename,label' and one line per image"
    try:
        # utf-8-sig: spreadsheet programs start their CSV files with a byte-order mark.
        with open(csv_path, encoding="utf-8-sig", newline="") as f:
            # The csv module rather than pandas: pandas turns extra fields into an
            # index and "0.5" into a float that int() truncates to a valid 0.
            reader = csv.reader(f)
            rows = []
            for row in reader:
                if any(v.strip() for v in row):  # blank lines are not images
                    rows.append((reader.line_num, [v.strip() for v in row]))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:  # unreadable, binary, NUL bytes
        raise ParallelxError(f"{csv_path}: not a readable CSV ({_brief(exc)}); {how}") from None
    if not rows:
        raise ParallelxError(f"{csv_path} is empty; {how} (or no train.csv, to label by file name)")
    header = rows[0][1]
    if header != ["filename", "label"]:
        raise ParallelxError(f"{csv_path}: expected the columns 'filename,label', found {','.join(header)}")
    if len(rows) == 1:
        raise ParallelxError(
            f"{csv_path} lists no images (only its header); add a line 'filename,label' per image, "
            "or remove it to label by file name"
        )
    pairs: list[tuple[Path, int]] = []
    lines: dict[str, list[int]] = {}
    for line, row in rows[1:]:
        if len(row) != 2:
            raise ParallelxError(
                f"{csv_path}: not a readable CSV: line {line} has {len(row)} field(s) "
                f"({','.join(row)}); expected 2, filename,label"
            )
        name, label = row
        if not name:
            raise ParallelxError(f"{csv_path} line {line}: the filename is empty")
        rel = PurePosixPath(name.replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts:
            raise ParallelxError(
                f"{csv_path} line {line}: {name!r} is not a path inside {images}; "
                "list file names relative to that folder"
            )
        lab = _csv_label(label)
        if lab is None:
            raise ParallelxError(f"{csv_path} line {line}: label {label!r} for {name} is not 0/1 or cat/dog")
        lines.setdefault(str(rel), []).append(line)
        pairs.append((images / rel, lab))
    dups = {name: at for name, at in lines.items() if len(at) > 1}
    if dups:
        name, at = next(iter(dups.items()))
        raise ParallelxError(
            f"{csv_path} lists {len(dups)} file(s) more than once, e.g. {name} on lines "
            f"{', '.join(map(str, at))}; each image must appear once"
        )
    absent = [p.name for p, _ in pairs if not p.is_file()]
    if absent:
        raise ParallelxError(
            f"{csv_path} lists {len(absent)} file(s) missing from {images}, e.g. {absent[0]}; "
            "remove those lines or restore the files"
        )
    return pairs


def list_dogcat(data_dir: str | Path, *, warn_ignored: bool = False) -> tuple[list[Path], list[int]]:
    """Image files and labels (0 = cat, 1 = dog), sorted by file name, without
    opening any image: cheap enough to check the layout before a process
    group is joined (where a warning would still print on every rank: hence
    ``warn_ignored``, for image files whose names give no label).

    Labels come from ``DIR/train.csv`` (columns ``filename,label``; label 0/1 or
    cat/dog) when present, else from the file names (``cat.*``, ``dog.*``).
    """
    root = Path(data_dir)
    images = _image_dir(root)
    csv_path = root / "train.csv"
    if csv_path.exists():
        pairs = _read_csv_listing(csv_path, images)
    else:
        pairs, unnamed = [], []
        try:
            entries = sorted(images.iterdir())
        except OSError as exc:
            raise ParallelxError(f"cannot list {images} ({exc.strerror or exc})") from None
        for p in entries:
            if p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir():
                lab = _label_from_name(p.name)
                if lab is None:
                    unnamed.append(p.name)
                else:
                    pairs.append((p, lab))
        if unnamed and pairs and warn_ignored:
            warn(
                f"ignored {len(unnamed)} image file(s) in {images} whose names start with neither cat. nor dog. "
                f"(e.g. {unnamed[0]}); label them in a train.csv (filename,label) to use them"
            )
    if not pairs:
        raise ParallelxError(
            f"no images found in {images}: expected Kaggle names like cat.0.jpg and dog.0.jpg "
            "(or a train.csv with filename,label)"
        )
    pairs.sort()
    return [p for p, _ in pairs], [lab for _, lab in pairs]


def is_decodable_image(path: Path) -> bool:
    """The file decodes as an image.  A header check alone passes files that
    are damaged after their header, which would then fail in the middle of
    training; a full decode costs more than needed.  ``draft`` lets the JPEG
    decoder scale by 1/8 while it still reads all of the image data, so a
    damaged file fails here at a fraction of the cost.  Measured on one
    core: 1,000 generated JPEGs (64 to 320 pixels a side) in 0.37 s, 1,000
    photo-sized ones (500 x 375) in 0.59 s, so Kaggle's 25,000 take about 15 s
    on one thread.  A PNG is decoded in full.  What libjpeg itself conceals
    (a file cut short whose end marker remains decodes, grey where data is
    missing) it conceals here too."""
    try:
        with Image.open(path) as img:
            img.draft("RGB", (1, 1))
            img.load()
        return True
    except Exception:  # unidentified, truncated, broken data stream, decompression bomb, unreadable
        return False


def _default_scan_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cores)


def scan_dogcat(data_dir: str | Path, *, threads: int | None = None) -> tuple[list[Path], list[int]]:
    """:func:`list_dogcat`, less the files that do not decode as images
    (wrong format, truncated, damaged), which are skipped with one warning
    that counts them.  Decoding runs on ``threads`` threads (PIL releases the
    GIL while it decodes)."""
    files, labels = list_dogcat(data_dir, warn_ignored=True)
    with ThreadPoolExecutor(max_workers=max(1, threads or _default_scan_threads())) as pool:
        ok = list(pool.map(is_decodable_image, files))
    bad = [p.name for p, good in zip(files, ok) if not good]
    if bad:
        warn(
            f"skipped {len(bad)} unreadable image file(s) in {files[0].parent} (not an image, truncated or "
            f"damaged): {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
    good = [(p, lab) for (p, lab), keep in zip(zip(files, labels), ok) if keep]
    if not good:
        raise ParallelxError(
            f"none of the {len(files)} image files in {files[0].parent} is readable "
            f"(e.g. {bad[0]}): every one fails to decode as an image"
        )
    counts = Counter(lab for _, lab in good)
    for label, name in enumerate(DOGCAT_CLASSES):
        if counts[label] == 0:
            warn(
                f"no readable {name} images among the {len(good)} in {files[0].parent}: "
                "the model can only learn to answer the other class"
            )
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
            raise ParallelxError(f"{len(files)} files but {len(labels)} labels; expected one label per file")
        if any(lab not in (0, 1) for lab in labels):
            raise ParallelxError(f"labels must be 0 (cat) or 1 (dog), found {sorted(set(labels) - {0, 1})}")
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
            raise ParallelxError(
                f"cannot decode {path} ({_brief(exc)}); it decoded when the data was scanned: "
                "was it changed during training?"
            ) from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.load_image(index)), self.labels[index]


def split_indices(n: int, val_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """A fixed-seed random split: (train indices, val indices), neither empty."""
    if not 0 < val_fraction < 1:
        raise ParallelxError(f"--val-fraction must be strictly between 0 and 1, got {val_fraction}")
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ParallelxError(
            f"--val-fraction {val_fraction} of {n} image(s) leaves no image to train on "
            f"({n_val} for val); lower --val-fraction or add images (at least 2 are needed)"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def load_dogcat(
    data_dir: str | Path, image_size: int, *, val_fraction: float = 0.2, seed: int = 0, threads: int | None = None
) -> tuple[Dataset, Dataset]:
    """(train, val) Dogs-vs-Cats datasets: a ``val_fraction`` split with a fixed seed."""
    files, labels = scan_dogcat(data_dir, threads=threads)
    train_idx, val_idx = split_indices(len(files), val_fraction, seed)
    return (
        Subset(DogCatDataset(files, labels, image_size, train=True), train_idx),
        Subset(DogCatDataset(files, labels, image_size, train=False), val_idx),
    )


# ---------------------------------------------------------------- text
def read_text(data_dir: str | Path) -> str:
    """The text of ``data_dir/input.txt`` (or of ``data_dir`` itself, a file),
    UTF-8, checked to be there, readable and not empty."""
    d = Path(data_dir)
    path = d if d.is_file() else d / TEXT_FILE
    if not path.is_file():
        raise ParallelxError(
            f"no text at {path}: pass --data-dir pointing at a folder holding {TEXT_FILE} (or the file "
            f"itself), generate one with `{MAKE_DATA} text --out DIR`, or leave --data-dir out to train "
            "on a generated text"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ParallelxError(
            f"{path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start : exc.start + 1]!r}); "
            "convert it with `iconv -t utf-8`"
        ) from None
    except OSError as exc:
        raise ParallelxError(f"cannot read {path} ({exc.strerror or exc})") from None
    if not text:
        raise ParallelxError(f"{path} is empty; expected the text to train on")
    return text


class CharWindows(Dataset):
    """Windows of ``block_size + 1`` consecutive tokens of ``tokens``, one every
    ``block_size``: sample ``i`` is ``(x, y)``, ``x`` the window's first
    ``block_size`` tokens and ``y`` the same shifted by one (each position's
    next token).  An epoch covers the text once."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ParallelxError(
                f"{len(tokens)} characters cannot fill one window of --block-size {block_size} plus its "
                f"next character; use a longer text or a --block-size below {max(1, len(tokens) - 1)}"
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def char_datasets(text: str, block_size: int, val_fraction: float = 0.1) -> tuple[CharWindows, CharWindows, list[str]]:
    """(train, val, vocabulary) of a character-level model: every distinct
    character is a token (sorted, so the ids depend on the text alone); the
    first ``1 - val_fraction`` of the text trains, the rest validates."""
    vocab = sorted(set(text))
    ids = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([ids[c] for c in text], dtype=torch.long)
    cut = int(len(tokens) * (1 - val_fraction))
    if min(cut, len(tokens) - cut) < block_size + 1:
        raise ParallelxError(
            f"a text of {len(text)} characters split {1 - val_fraction:.0%}/{val_fraction:.0%} leaves "
            f"{min(cut, len(tokens) - cut)} characters to one side, less than one window of --block-size "
            f"{block_size} plus one; use a longer text, a smaller --block-size or another --val-fraction"
        )
    return CharWindows(tokens[:cut], block_size), CharWindows(tokens[cut:], block_size), vocab


# --------------------------------------------- reproducible augmentation
def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: a mix of the run's seed, the
    epoch and the dataset index (the same on every rank, in every worker
    process, at every world size, before and after a resume)."""
    x = seed % 2**64
    for v in (epoch, index):
        x = (x * 6364136223846793005 + v + 1442695040888963407) % 2**64
        x ^= x >> 29
    return x % 2**63


class EpochKeys(Sampler):
    """Hands out ``(epoch, index)`` keys for :class:`SeededSamples`: the
    indices of ``sampler`` (a :class:`parallelx.ShardedSampler`) tagged with
    the epoch of the pass they belong to.  The DataLoader draws them in the
    main process and sends them to its workers, so the epoch a worker sees is
    the one of the pass, even with ``persistent_workers``."""

    def __init__(self, sampler: ShardedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = iter(self.sampler)  # starts the pass: last_epoch is now this pass's epoch
        epoch = self.sampler.last_epoch
        return ((epoch, i) for i in indices)

    def __len__(self) -> int:
        return len(self.sampler)


class SeededSamples(Dataset):
    """``dataset`` indexed by ``(epoch, index)`` keys, returning ``(x, y,
    index)``: each sample's random augmentation runs on torch's generator
    seeded from ``(seed, epoch, index)`` alone, then the generator is put
    back.  The flips are then the same whichever process, worker or rank
    loads the sample, so a run resumed mid-epoch, with or without worker
    processes, at another world size, sees the images the uninterrupted run
    saw; and loading never draws from the training process's generator."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, Any, int]:
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would also reseed CUDA's, outside the fork.
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            x, y = self.dataset[index]
        return x, y, index


# ------------------------------------------------------------------ loaders
def default_num_workers(local_world_size: int) -> int:
    """Loader workers per process: this process's share of the cores, less
    the one that trains, at most 8.  0 (load in the training process) when a
    process has a single core: more workers would only fight over it."""
    return min(8, threads_per_process(local_world_size) - 1)


def make_loader(
    backend: Backend,
    dataset: Dataset,
    sampler: ShardedSampler,
    *,
    batch_size: int,
    num_workers: int | None,
    seed: int,
    seeded_augmentation: bool = False,
) -> DataLoader:
    """The loader of one split, drawing this rank's shard from ``sampler``.

    - ``num_workers`` None: :func:`default_num_workers`, sized per process
      (not ``cpu_count()`` in every process);
    - random augmentations differ between ranks (the loader's generator is
      seeded by rank); the shuffle does not (the sampler's);
    - ``seeded_augmentation``: batches are ``(x, y, index)`` and each sample's
      augmentation depends on (seed, epoch, index) only (:class:`SeededSamples`),
      which an exact resume needs;
    - an error raised in a loader worker arrives as its own one-line message.
    """
    workers = default_num_workers(backend.local_world_size) if num_workers is None else num_workers
    share = threads_per_process(backend.local_world_size)
    if workers > share:
        warn(
            f"--num-workers {workers} is more than this process's share of the CPU cores ({share}); "
            "the extra workers only compete for them"
        )
    return _Loader(
        SeededSamples(dataset, seed) if seeded_augmentation else dataset,
        batch_size=batch_size,
        sampler=EpochKeys(sampler) if seeded_augmentation else sampler,
        num_workers=workers,
        pin_memory=backend.device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=_own_process_group,
        generator=torch.Generator().manual_seed(seed + 1000 * backend.rank),
    )


class _Loader(DataLoader):
    """A DataLoader whose workers' errors arrive with their own message: the
    DataLoader re-raises them with the worker's traceback added, many lines
    where the recipes print one."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        try:
            yield from super().__iter__()
        except ParallelxError as exc:
            raise ParallelxError(_worker_message(str(exc))) from None


def _worker_message(message: str) -> str:
    marker = "ParallelxError: "
    if "Original Traceback" in message and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


def _own_process_group(worker_id: int) -> None:
    """Loader workers leave their training process's process group: torchrun
    sends SIGTERM to that whole group, and a loader worker that dies of it
    takes its training process down before that process can save its
    checkpoint (see ``parallelx.Preemption``).  Workers still end with the
    loader (which may SIGTERM them itself), or within seconds of their
    training process."""
    os.setpgid(0, 0)
