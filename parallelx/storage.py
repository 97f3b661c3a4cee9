"""Where checkpoints live: a local path, or a URL of an object store, by one road.

Every checkpoint writer and reader (``Backend.save`` / ``load``, the
training-state checkpoints, the :class:`parallelx.Checkpointer`) names its
files through this module.  A *location* is either a local
:class:`~pathlib.Path` (``file:///abs/path`` is one too) or the string of an
fsspec URL (``s3://bucket/run``, ``gs://...``, ``az://...``, ``memory://...``)::

    loc = storage.location("s3://bucket/run")     # a str; storage.location("runs/x") is a Path
    storage.save(state, storage.join(loc, "weights.pt"))
    state = storage.load(storage.join(loc, "weights.pt"))   # torch.load(..., weights_only=True)

A local file is written as before: into a temporary file beside it, flushed,
renamed into place.  An object in a store appears whole or not at all when its
one upload ends, so it is written in one put (retried as a whole); what a store
cannot do, a rename of a folder, the training-state checkpoints replace by a
commit record (:mod:`parallelx.checkpoints.trainstate`).

The filesystem packages are an extra (``pip install 'parallelx[s3]'``: fsspec and
s3fs).  Credentials and the endpoint come from where the AWS tools read them:
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and
``~/.aws/``, ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for an
S3-compatible store; never from a command line, and no message here holds a
secret.  A refused key or a missing bucket is a :class:`StoreError` at once,
naming the URL and the cause; other failures (a dropped connection, a store
that answers 503) are tried again, a bounded number of times (5, waiting 7.5 s in all;
``PARALLELX_STORE_ATTEMPTS`` sets another).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import torch

from parallelx import log
from parallelx.errors import ParallelxError, first_line

#: A local path, or the string of a URL.
Location = Path | str
Target = str | os.PathLike[str]
T = TypeVar("T")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: The package each scheme needs, and how to install it.
_PACKAGES = {
    "s3": ("s3fs", "pip install 'parallelx[s3]'"),
    "s3a": ("s3fs", "pip install 'parallelx[s3]'"),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
    "abfss": ("adlfs", "pip install adlfs"),
}
#: Tries of one operation on a store (``PARALLELX_STORE_ATTEMPTS`` sets another number), and the first
#: wait between two (doubled each time, at most 8 s): 5 tries wait 7.5 s in all.
ATTEMPTS = 5
FIRST_WAIT_S = 0.5


def attempts() -> int:
    """How many times one operation on a store is tried: ``$PARALLELX_STORE_ATTEMPTS`` or :data:`ATTEMPTS`."""
    raw = os.environ.get("PARALLELX_STORE_ATTEMPTS")
    if raw is None:
        return ATTEMPTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ParallelxError(f"PARALLELX_STORE_ATTEMPTS must be a whole number >= 1, got {raw!r}")
    return value


class StoreError(ParallelxError):
    """An object store refused or failed an operation (after the retries, where retrying could help)."""


def is_url(target: Target | Location) -> bool:
    """Whether ``target`` is written as a URL (``scheme://...``)."""
    return bool(_SCHEME.match(os.fspath(target)))


def location(target: Target | Location) -> Location:
    """``target`` as a location: a :class:`Path` for a local path (and for ``file://``), else the URL as a str
    (no trailing slash).  ``Path("s3://b/x")`` would fold the ``//``: a URL must never become a Path."""
    text = os.fspath(target)
    match = _SCHEME.match(text)
    if match is None:
        return Path(text)
    if match.group(1).lower() == "file":
        return Path(text[len(match.group(0)) :] or "/")
    return text.rstrip("/")


def is_remote(loc: Location) -> bool:
    """Whether ``loc`` (from :func:`location`) is in a store rather than on a local disk."""
    return isinstance(loc, str)


def join(loc: Location, *names: str) -> Location:
    """``loc`` with ``names`` below it."""
    if isinstance(loc, Path):
        return loc.joinpath(*names)
    return "/".join([loc, *names])


def parent(loc: Location) -> Location:
    """The folder holding ``loc``."""
    return loc.parent if isinstance(loc, Path) else loc.rsplit("/", 1)[0]


def name(loc: Location) -> str:
    """The last part of ``loc``."""
    return loc.name if isinstance(loc, Path) else loc.rsplit("/", 1)[-1]


def show(loc: Location | Target) -> str:
    """``loc`` as a message may print it: a URL without any ``user:password@`` in it."""
    text = os.fspath(loc)
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", text)


# ------------------------------------------------------------------ the filesystems of URLs
_filesystems: dict[str, Any] = {}


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it."""
    scheme = url.split("://", 1)[0].lower()
    _, pip = _PACKAGES.get(scheme, ("fsspec", "pip install 'parallelx[s3]'"))
    if scheme not in _filesystems:
        options = filesystem_options(url)  # the packages' pip command where they are missing
        import fsspec

        try:
            _filesystems[scheme] = fsspec.filesystem(scheme, **options)
        except (ImportError, ValueError) as exc:
            raise ParallelxError(
                f"{show(url)}: no filesystem for {scheme}:// ({first_line(exc)}); install it: {pip}"
            ) from None
    import fsspec

    return _filesystems[scheme], fsspec.core.strip_protocol(url)


def filesystem_options(url: str) -> dict[str, Any]:
    """The options parallelx makes ``url``'s fsspec filesystem with (for a library that makes its own,
    as ``torch.distributed.checkpoint``'s ``FsspecReader`` does): the endpoint from the environment,
    no listing cache, a filesystem made anew.  The credentials are the filesystem's own usual places."""
    scheme = url.split("://", 1)[0].lower()
    package, pip = _PACKAGES.get(scheme, ("fsspec", "pip install 'parallelx[s3]'"))
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise ParallelxError(f"{show(url)}: a URL needs the filesystem packages: {pip}") from None
    options: dict[str, Any] = {}
    if package == "s3fs":
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ParallelxError(f"{show(url)}: an s3:// URL needs s3fs: {pip}") from None
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        # A listing is read again each time: a checkpoint another rank (or run) just committed must show.
        options["use_listings_cache"] = False
    # Made anew (fsspec would hand back one made with the variables of an earlier call).
    options["skip_instance_cache"] = True
    return options


def _permanent(exc: BaseException) -> str | None:
    """Why ``exc`` will not go away by trying again, or None where it may."""
    kind = type(exc).__name__
    if isinstance(exc, PermissionError) or kind in ("NoCredentialsError", "PartialCredentialsError"):
        return (
            f"access denied ({kind}: {first_line(exc)}); check the credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials) and the endpoint (AWS_ENDPOINT_URL)"
        )
    if isinstance(exc, (ParallelxError, ValueError, TypeError, NotImplementedError, IsADirectoryError)):
        return f"{kind}: {first_line(exc)}"
    return None


def _call(url: str, what: str, op: Callable[[], T]) -> T:
    """``op`` on the store, tried again on a transient failure; FileNotFoundError goes to the caller."""
    wait = FIRST_WAIT_S
    tries = attempts()
    for attempt in range(1, tries + 1):
        try:
            return op()
        except FileNotFoundError:
            raise
        except Exception as exc:  # sorted: permanent ends at once, the rest is tried again
            cause = _permanent(exc)
            if cause is not None:
                raise StoreError(f"{what} {show(url)} failed: {cause}") from None
            if attempt == tries:
                raise StoreError(
                    f"{what} {show(url)} failed {tries} times ({type(exc).__name__}: {first_line(exc)})"
                ) from None
            log.warn(f"{what} {show(url)}: {type(exc).__name__}: {first_line(exc)}; trying again in {wait:.1f} s")
            time.sleep(wait)
            wait = min(wait * 2, 8.0)
    raise AssertionError("unreachable")


def _bucket(url: str) -> str:
    return url.split("://", 1)[0] + "://" + url.split("://", 1)[1].split("/", 1)[0]


def probe(loc: Location) -> None:
    """Check that the store of ``loc`` answers and its bucket exists, before a run relies on it:
    a missing bucket or a refused key is one :class:`StoreError` naming ``loc``.  Local: nothing."""
    if not isinstance(loc, str):
        return
    fs, _ = _filesystem(loc)
    bucket = _bucket(loc)
    try:
        _call(loc, "reaching", lambda: fs.ls(_filesystem(bucket)[1], detail=False))
    except FileNotFoundError:
        raise StoreError(f"{show(loc)}: the bucket {show(bucket)} does not exist (create it first)") from None


# ------------------------------------------------------------------ reading
def exists(loc: Location) -> bool:
    """Whether a file (or, locally, a folder) is at ``loc``."""
    if isinstance(loc, Path):
        return loc.exists()
    fs, path = _filesystem(loc)
    try:
        return bool(_call(loc, "looking for", lambda: fs.exists(path)))
    except FileNotFoundError:
        return False


def is_file(loc: Location) -> bool:
    """Whether a file is at ``loc``."""
    if isinstance(loc, Path):
        return loc.is_file()
    fs, path = _filesystem(loc)
    try:
        return bool(_call(loc, "looking for", lambda: fs.isfile(path)))
    except FileNotFoundError:
        return False


def listdir(loc: Location) -> list[str]:
    """The names directly under ``loc`` (files and folders); none where there is nothing."""
    if isinstance(loc, Path):
        return [p.name for p in loc.iterdir()] if loc.is_dir() else []
    fs, path = _filesystem(loc)
    try:
        found = _call(loc, "listing", lambda: fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    here = path.rstrip("/")
    names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in found if str(p).rstrip("/") != here}
    return sorted(names)


def read_bytes(loc: Location) -> bytes:
    """The whole file at ``loc``; FileNotFoundError where there is none."""
    if isinstance(loc, Path):
        return loc.read_bytes()
    fs, path = _filesystem(loc)
    return bytes(_call(loc, "reading", lambda: fs.cat_file(path)))


def read_range(loc: Location, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of the file at ``loc`` (one ranged read from a store: a tensor's rows
    without the rest of its file); FileNotFoundError where there is none."""
    if isinstance(loc, Path):
        with open(loc, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, path = _filesystem(loc)
    data = bytes(_call(loc, "reading", lambda: fs.cat_file(path, start=start, end=end)))
    if len(data) != end - start:
        raise StoreError(f"reading {show(loc)} failed: bytes {start}-{end} asked, {len(data)} came (a shorter file)")
    return data


def load(loc: Location, *, weights_only: bool = True) -> Any:
    """``torch.load`` of the file at ``loc`` onto the CPU, as strict as a local file
    (``weights_only``); a missing or unreadable file is one clear error."""
    if isinstance(loc, Path):
        if not loc.is_file():
            raise ParallelxError(f"checkpoint {loc} does not exist")
        try:
            return torch.load(loc, map_location="cpu", weights_only=weights_only)
        except Exception as exc:  # truncated, not a torch file, pickled objects refused by weights_only
            raise ParallelxError(f"checkpoint {loc} cannot be read ({type(exc).__name__}: {first_line(exc)})") from None
    try:
        data = read_bytes(loc)
    except FileNotFoundError:
        raise ParallelxError(f"checkpoint {show(loc)} does not exist") from None
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # truncated, not a torch file, pickled objects refused by weights_only
        raise ParallelxError(
            f"checkpoint {show(loc)} cannot be read ({type(exc).__name__}: {first_line(exc)})"
        ) from None


# ------------------------------------------------------------------ writing
def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Create ``path``, fill it with ``write`` and flush it to disk."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Fill a temporary file beside ``path`` with ``write``, flush it, then
    rename it into place: a failure (or a crash) leaves any previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_synced(Path(tmp), write)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write(loc: Location, fill: Callable[[IO[bytes]], object], *, atomic: bool = True) -> None:
    """Write the file at ``loc`` with ``fill``.  Local: into a temporary file renamed into
    place (``atomic``), or straight into ``loc``, flushed to disk (a file inside a folder that
    is itself published by a rename).  A store: one upload, which appears whole or not at all."""
    if isinstance(loc, Path):
        if atomic:
            atomic_write(loc, fill)
        else:
            write_synced(loc, fill)
        return
    buffer = io.BytesIO()
    fill(buffer)
    data = buffer.getvalue()
    fs, path = _filesystem(loc)
    try:
        _call(loc, "writing", lambda: fs.pipe_file(path, data))
    except FileNotFoundError as exc:  # a missing bucket
        raise StoreError(f"writing {show(loc)} failed: {first_line(exc)} (does the bucket exist?)") from None


def upload(source: Path, loc: Location) -> None:
    """Copy the local file ``source`` to ``loc``, streamed (a store's multipart upload: a file of
    gigabytes is never whole in memory), tried again on a transient failure as every call is."""
    if isinstance(loc, Path):
        atomic_write(loc, lambda out: _copy_file(source, out))
        return
    fs, path = _filesystem(loc)
    # s3fs sends a file in parts of `chunksize`, `max_concurrency` at a time (a file under two parts at
    # once): 16 MiB x 4 keeps the memory an upload takes bounded (by default a rank's 1.2 GB shard file
    # took 1 GB more resident memory), and its speed to a store on this machine (benchmarks.checkpoint_save).
    options = {"chunksize": UPLOAD_PART, "max_concurrency": 4} if type(fs).__name__ == "S3FileSystem" else {}
    try:
        _call(loc, "uploading to", lambda: fs.put_file(str(source), path, **options))
    except FileNotFoundError as exc:  # a missing bucket
        raise StoreError(f"uploading to {show(loc)} failed: {first_line(exc)} (does the bucket exist?)") from None


#: The part of a streamed upload to S3 (s3fs's chunksize).
UPLOAD_PART = 16 * 2**20


def download(loc: Location, target: Path) -> None:
    """Copy the file at ``loc`` to the local file ``target``, streamed."""
    if isinstance(loc, Path):
        shutil.copyfile(loc, target)
        return
    fs, path = _filesystem(loc)
    try:
        _call(loc, "downloading", lambda: fs.get_file(path, str(target)))
    except FileNotFoundError:
        raise ParallelxError(f"{show(loc)} does not exist") from None


def dcp_reader(folder: Location) -> Any:
    """``torch.distributed.checkpoint``'s reader of a DCP folder, local or in a store (fsspec, made
    with :func:`filesystem_options`: each read asks for the byte ranges it needs)."""
    import torch.distributed.checkpoint as dcp

    if isinstance(folder, Path):
        return dcp.FileSystemReader(str(folder))
    from torch.distributed.checkpoint import FsspecReader

    return FsspecReader(folder, **filesystem_options(folder))


def _copy_file(source: Path, out: IO[bytes]) -> None:
    with open(source, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 24)


def save(obj: Any, loc: Location, *, atomic: bool = True) -> None:
    """``torch.save`` through :func:`write`."""
    write(loc, lambda f: torch.save(obj, f), atomic=atomic)


def write_text(loc: Location, text: str) -> None:
    """A small text file (a pointer, a record), written as :func:`write` does."""
    write(loc, lambda f: f.write(text.encode()))


def makedirs(loc: Location) -> None:
    """The folder ``loc`` and its parents, locally; a store has no folders (nothing to do)."""
    if isinstance(loc, Path):
        loc.mkdir(parents=True, exist_ok=True)


def remove(loc: Location) -> None:
    """Remove the file or the folder (with all below it) at ``loc``; nothing there is fine."""
    if isinstance(loc, Path):
        if loc.is_dir():
            shutil.rmtree(loc, ignore_errors=True)
        else:
            loc.unlink(missing_ok=True)
        return
    fs, path = _filesystem(loc)
    try:
        _call(loc, "removing", lambda: fs.rm(path, recursive=True))
    except FileNotFoundError:
        pass
