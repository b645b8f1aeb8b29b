"""Atomic output files and safe input loading shared by every package (lowest layer: numpy only).

Every file this project writes goes through :func:`atomic_write`: the bytes go to a temporary file in
the destination folder, are fsynced, then renamed over the target. A crash or an exception half-way
leaves whatever was at the target before untouched and removes the temporary file. A replaced file
keeps its permission bits; a new one gets ``0o666 & ~umask``, as ``open()`` would give it.
:func:`check_outputs` refuses, before anything is written, an output that is one of the inputs (also
through a symlink or a hard link), two outputs that are one file, and an output folder that is missing
or not writable.

An output folder (``layout --output``, ``advise --output``, ``inspect --plot``, ``demo --out``) holds one
run's files, whole (:func:`claim_folder`, :func:`publish_folder`, in :mod:`moe_placement.base.folders`):
published as a unit with a manifest, the previous run's files of the same command that this run does
not write removed, files it did not write never touched, and a concurrent run refused.

Inputs are opened only when they are regular files (:func:`open_regular`, :func:`require_regular`): a
FIFO or a device passed as an input is refused at once instead of blocking or reading forever.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import signal
import socket
import stat
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from moe_placement.base.textparse import InputFileError, parse_json

try:  # POSIX: the folder lock that serialises concurrent writers of one file pair
    import fcntl
except ImportError:  # pragma: no cover - elsewhere the sidecar's digest still refuses a mixed pair
    fcntl = None

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "json_bytes",
    "atomic_write_files",
    "clean_stale_temps",
    "deferred_signals",
    "atomic_save_npz",
    "npz_bytes",
    "check_outputs",
    "check_writable_folder",
    "load_npy",
    "load_npz",
    "load_json",
    "open_regular",
    "read_regular_bytes",
    "require_regular",
    "InputFileError",
]

# A declared array larger than this is refused before allocation (override per call).
DEFAULT_MAX_ARRAY_BYTES = 8 * 1024**3


# ---------------------------------------------------------------------------------------------
# inputs: regular files only
# ---------------------------------------------------------------------------------------------


def _not_regular_msg(p: Path, mode: int) -> str:
    if stat.S_ISDIR(mode):
        return f"{p}: is a folder, expected a file; pass the file inside it"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{p}: is {kind}, not a regular file; inputs are read only from regular files: save it to a file first"


def require_regular(path: str | os.PathLike) -> Path:
    """``path`` as a :class:`Path` when it is a regular file (symlinks followed), else an
    :class:`InputFileError`: missing, unreadable, a folder, a FIFO, a socket or a device."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such file") from None
    except OSError as exc:
        raise InputFileError(f"{p}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(_not_regular_msg(p, st.st_mode))
    return p


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """Open ``path`` for binary reading only if it is a regular file.

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a FIFO (or a file swapped
    for one after a check) never blocks the open; the descriptor is made blocking again for reading.
    """
    p = require_regular(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputFileError(f"{p}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(_not_regular_msg(p, st.st_mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """The whole of a regular file, refused above ``max_bytes`` before it is read."""
    p = require_regular(path)
    with open_regular(p) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise InputFileError(f"{p}: {size} bytes is over the {max_bytes}-byte limit for {what}")
        return fh.read(max_bytes + 1)


# ---------------------------------------------------------------------------------------------
# outputs: checked before anything is written, then written atomically
# ---------------------------------------------------------------------------------------------


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _check_output_folder(out: Path) -> None:
    """The folder that will hold ``out`` exists and is writable; ``out`` itself, when it exists, is a
    regular file (the atomic rename would replace a FIFO, device or symlinked folder entry)."""
    folder = Path(os.path.realpath(out)).parent
    if not folder.is_dir():
        raise InputFileError(f"cannot write {out}: folder {folder} does not exist; create it first")
    check_writable_folder(folder, str(out))
    if os.path.lexists(out):
        try:
            mode = os.stat(out).st_mode
        except OSError:  # a dangling symlink: the rename replaces the link
            return
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise InputFileError(f"cannot write {out}: it exists and is {what}; choose a file path")


def check_writable_folder(folder: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, a folder a file cannot be created in: a temporary file is made in it and
    removed at once (permission bits alone miss a read-only file system, and say nothing for root).

    Raises:
        InputFileError: naming ``what`` (the output), the folder and the system's reason.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=f".moe-placement-probe.{_temp_tag()}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputFileError(
            f"cannot write {what}: no file can be created in folder {folder} ({exc.strerror or exc}); "
            f"choose another output folder"
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_outputs(
    inputs: Sequence[str | os.PathLike | None], outputs: Sequence[str | os.PathLike | None]
) -> None:
    """Refuse a set of outputs before anything is written (``None`` entries are skipped).

    Raises:
        InputFileError: an output resolves (symlinks and hard links included) to one of the inputs,
            two outputs resolve to the same file, an output's folder is missing or not writable, or an
            existing output is a folder, FIFO or device.
    """
    ins = [str(i) for i in inputs if i is not None]
    outs = [str(o) for o in outputs if o is not None]
    for o in outs:
        for i in ins:
            if _same_file(o, i):
                raise InputFileError(
                    f"output {o} is the input {i} (same file: {os.path.realpath(o)}); writing it would "
                    f"destroy the input: choose another output path"
                )
    for k, o in enumerate(outs):
        for other in outs[:k]:
            if _same_file(o, other):
                raise InputFileError(
                    f"outputs {other} and {o} are the same file ({os.path.realpath(o)}); the second would "
                    f"overwrite the first: give each output its own path"
                )
    for o in outs:
        _check_output_folder(Path(o))


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux ``/proc``)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def _target_mode(target: Path) -> int:
    """Permission bits for the file replacing ``target``: the existing file's, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _temp_tag() -> str:
    """``<host>-<pid>``: whose temporary file it is (host sanitized to letters, digits and '-')."""
    host = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def clean_stale_temps(target: str | os.PathLike) -> list[Path]:
    """Remove the temporary files ``.<name>.<host>-<pid>.*.tmp`` of ``target`` that a killed writer
    on this host left behind (its process is gone); a live writer's file, or another host's, is kept.

    Returns the files removed.
    """
    t = Path(target)
    folder = _folder(t)
    host = _temp_tag().rsplit("-", 1)[0]
    removed = []
    for tmp in folder.glob(f".{glob.escape(t.name)}.*.tmp"):
        tag = tmp.name[len(t.name) + 2 :].split(".", 1)[0]  # <host>-<pid>
        h, _, pid = tag.rpartition("-")
        if h == host and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def _folder(target: Path) -> Path:
    return target.parent if str(target.parent) else Path(".")


@contextlib.contextmanager
def _temp_file(target: Path, mode: str = "wb") -> Iterator[tuple[IO, str]]:
    """Open a temporary sibling ``.<name>.<host>-<pid>.XXXX.tmp`` of ``target`` (stale ones of killed
    writers removed first); fsynced when the block ends, removed if it raises."""
    folder = _folder(target)
    if not folder.is_dir():
        raise InputFileError(f"cannot write {target}: folder {folder} does not exist; create it first")
    if target.is_dir():
        raise InputFileError(f"cannot write {target}: it is a folder; give a file path inside it")
    clean_stale_temps(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{_temp_tag()}.", suffix=".tmp", dir=folder)
    try:
        with contextlib.suppress(OSError):  # mkstemp makes 0600; keep the target's (or umask's) mode
            os.fchmod(fd, _target_mode(target))
        with os.fdopen(fd, mode) as fh:
            yield fh, tmp
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # make the renames durable where the OS allows it
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


_DEFERRED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back while the block runs (delivered when it ends), so that a
    signal lands before or after a group of renames, never between them."""
    with contextlib.ExitStack() as stack:
        if hasattr(signal, "pthread_sigmask"):
            old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
            stack.callback(signal.pthread_sigmask, signal.SIG_SETMASK, old)
        yield


@contextlib.contextmanager
def _publishing(folders: Sequence[Path]) -> Iterator[None]:
    """Hold an exclusive lock on every folder and defer SIGINT/SIGTERM/SIGHUP while renaming, so that
    concurrent writers of one pair publish one after the other and a signal lands before or after the
    renames, never between them (SIGKILL still can: readers check the sidecar's digest)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(deferred_signals())
        for folder in sorted({os.path.realpath(f) for f in folders}) if fcntl is not None else ():
            with contextlib.suppress(OSError):
                fd = os.open(folder, os.O_RDONLY)
                stack.callback(os.close, fd)
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when closed
        yield


def _publish(pairs: Sequence[tuple[str, Path]]) -> None:
    """Rename every ``(temporary file, target)`` as one step (:func:`_publishing`), then make it durable."""
    with _publishing([_folder(t) for _, t in pairs]):
        for tmp, t in pairs:
            os.replace(tmp, t)
    for folder in {_folder(t) for _, t in pairs}:
        _fsync_folder(folder)


def _unlink_all(paths) -> None:
    for tmp in paths:  # a renamed one no longer exists under its unique temporary name
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def atomic_write_files(files: Sequence[tuple[str | os.PathLike, bytes]]) -> list[Path]:
    """Write several files as one (a map and its sidecar): each goes to a fsynced temporary sibling
    first, then all are renamed over their targets under a folder lock with signals deferred.

    A failure or an interrupt before the renames leaves every target as it was and no temporary file;
    two concurrent calls for the same targets leave all files of one of them. Returns the targets.
    """
    pairs: list[tuple[str, Path]] = []
    try:
        for t, data in files:
            with _temp_file(Path(t)) as (fh, tmp):
                fh.write(data)
            pairs.append((tmp, Path(t)))
        _publish(pairs)
    except BaseException:
        _unlink_all(tmp for tmp, _ in pairs)
        raise
    return [t for _, t in pairs]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; rename it over ``path`` on success.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    with _temp_file(target, mode) as (fh, tmp):
        yield fh
    try:
        _publish([(tmp, target)])
    except BaseException:
        _unlink_all([tmp])
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_write(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj, indent: int | None = 1) -> None:
    """``obj`` as JSON; NaN and infinities are refused (bare ``NaN`` is not JSON: most readers fail on it)."""
    atomic_write_bytes(path, json_bytes(path, obj, indent))


def json_bytes(path, obj, indent: int | None = 1) -> bytes:
    """The bytes :func:`atomic_write_json` writes to ``path`` (for :func:`atomic_write_files`)."""
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError as exc:
        raise ValueError(
            f"cannot write {path}: the data holds NaN or an infinity ({exc}), which JSON cannot represent; "
            f"the input load was probably non-finite or too large: check it"
        ) from None
    return (text + "\n").encode("utf-8")


def atomic_save_npz(path, compress: bool = True, **arrays) -> None:
    """``np.savez`` into a temporary file, then rename. No object arrays (no pickle)."""
    atomic_write_bytes(path, npz_bytes(compress, **arrays))


def npz_bytes(compress: bool = True, **arrays) -> bytes:
    """The bytes :func:`atomic_save_npz` writes (for a folder published as a unit). No object arrays."""
    for k, v in arrays.items():
        if np.asarray(v).dtype == object:
            raise ValueError(f"array {k!r} has dtype object; only numeric and string arrays are written")
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    return buf.getvalue()


def _npz_declared_bytes(path: Path) -> int:
    total = 0
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            total += info.file_size
    return total


def load_npz(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
    """Load every array of an ``.npz`` without pickle, refusing oversized or corrupt files.

    Raises:
        InputFileError: missing file, not a zip/npz, truncated member, object arrays, or arrays whose
            declared size exceeds ``max_bytes``.
    """
    p = require_regular(path)
    try:
        declared = _npz_declared_bytes(p)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputFileError(
            f"{p}: not a readable .npz archive ({exc}); expected a file written by numpy.savez"
        ) from None
    if declared > max_bytes:
        raise InputFileError(
            f"{p}: arrays declare {declared / 1e9:.1f} GB uncompressed, over the {max_bytes / 1e9:.1f} GB limit; "
            f"split the trace or raise the limit"
        )
    out: dict[str, np.ndarray] = {}
    try:
        with np.load(p, allow_pickle=False) as z:
            for k in z.files:
                out[k] = z[k]
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise InputFileError(f"{p}: contains object (pickled) arrays, which are never loaded") from None
        raise InputFileError(f"{p}: corrupt array data ({exc})") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, TypeError) as exc:
        raise InputFileError(f"{p}: corrupt or truncated .npz ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # zlib.error and friends from a damaged member
        raise InputFileError(f"{p}: corrupt or truncated .npz ({type(exc).__name__}: {exc})") from None
    return out


def load_json(path: str | os.PathLike, max_bytes: int = 1024**3):
    """A JSON file (regular files only, at most ``max_bytes``), duplicate keys refused
    (:func:`moe_placement.base.textparse.parse_json`)."""
    p = require_regular(path)
    data = read_regular_bytes(p, max_bytes, "a JSON file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_json(text, str(p))


def load_npy(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_ARRAY_BYTES) -> np.ndarray:
    """One ``.npy`` array without pickle: regular files only, the header's declared size checked
    against ``max_bytes`` before the data is read.

    Raises:
        InputFileError: missing or not a regular file, a bad header, object arrays, too large, truncated.
    """
    p = require_regular(path)
    with open_regular(p) as fh:
        try:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        except (ValueError, OSError, EOFError) as exc:
            raise InputFileError(
                f"{p}: not a .npy array file ({exc}); expected a file written by numpy.save"
            ) from None
        if dtype.hasobject:
            raise InputFileError(f"{p}: holds objects (pickle), which are never loaded")
        declared = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        if declared > max_bytes:
            raise InputFileError(
                f"{p}: the array declares {declared / 1e9:.1f} GB ({shape} {dtype}), over the "
                f"{max_bytes / 1e9:.1f} GB limit"
            )
        fh.seek(0)
        try:
            return np.load(fh, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputFileError(f"{p}: corrupt or truncated .npy ({exc})") from None


def iter_npz_array_chunks(path: str | os.PathLike, key: str, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
    """Stream one array of an ``.npz`` along its first axis without loading it whole.

    Works for compressed and stored members (zipfile decompresses as it reads). Memory is bounded by
    ``chunk_rows`` rows. Object arrays are refused.

    Yields:
        arrays ``[<= chunk_rows, *shape[1:]]`` in order.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    p = require_regular(path)
    try:
        zf = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError) as exc:
        raise InputFileError(f"{p}: not a readable .npz archive ({exc})") from None
    with zf:
        name = key + ".npy"
        if name not in zf.namelist():
            raise InputFileError(f"{p}: no array {key!r} (arrays: {[n[:-4] for n in zf.namelist()]})")
        with zf.open(name) as fh:
            try:
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            except ValueError as exc:
                raise InputFileError(f"{p}: array {key!r} has a bad header ({exc})") from None
            if dtype.hasobject:
                raise InputFileError(f"{p}: array {key!r} holds objects (pickle), which are never loaded")
            if fortran and len(shape) > 1:
                raise InputFileError(f"{p}: array {key!r} is Fortran-ordered; cannot stream it by rows")
            if not shape:
                raise InputFileError(f"{p}: array {key!r} is a scalar; expected rows")
            row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            left = int(shape[0])
            while left:
                n = min(left, chunk_rows)
                buf = fh.read(n * row)
                if len(buf) != n * row:
                    raise InputFileError(f"{p}: array {key!r} is truncated ({left} rows missing)")
                yield np.frombuffer(buf, dtype=dtype).reshape((n,) + tuple(shape[1:]))
                left -= n


def safe_torch_load(
    path: str | os.PathLike, max_bytes: int, what: str = "a .pt file", data: bytes | None = None
):
    """``torch.load(weights_only=True)`` with a size check; torch is imported lazily.

    Only tensors, dicts, lists and numbers are loaded, never pickled objects. Any failure becomes an
    :class:`InputFileError` naming the file. ``data``: the file's bytes, already read.
    """
    p = require_regular(path) if data is None else Path(path)
    size = p.stat().st_size if data is None else len(data)
    if size > max_bytes:
        raise InputFileError(f"{p}: {size} bytes is over the {max_bytes}-byte limit for {what}")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional extra
        raise InputFileError(
            f"{p}: reading {what} needs torch (pip install 'moe-placement[torch]')"
        ) from None
    try:
        return torch.load(p if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError (bad zip), EOFError, ...
        raise InputFileError(
            f"{p}: not a safe torch.save file ({_torch_load_cause(exc, size)}); "
            f"only tensors, dicts, lists and numbers are loaded, never pickled objects"
        ) from None


def _torch_load_cause(exc: Exception, size: int) -> str:
    """What went wrong in ``torch.load``, in our words (torch's own messages run to a paragraph)."""
    text = " ".join(str(exc).split())
    if size == 0:
        return "the file is empty"
    if isinstance(exc, EOFError) or "zip archive" in text or "central directory" in text:
        return "a truncated or corrupt archive"
    if type(exc).__name__ == "UnpicklingError":
        return "not a torch.save archive, or it holds objects other than tensors, dicts, lists and numbers"
    return f"{type(exc).__name__}: {text.split('. ')[0][:120]}"
