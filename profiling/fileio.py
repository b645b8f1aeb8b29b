"""Atomic output files and safe input loading shared by every package (lowest layer: numpy only).

Every file this project writes goes through :func:`atomic_write`: the bytes go to a temporary file in
the destination folder, are fsynced, then renamed over the target. A crash or an exception half-way
leaves whatever was at the target before untouched and removes the temporary file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_save_npz",
    "load_npz",
    "load_json",
    "InputFileError",
]

# A declared array larger than this is refused before allocation (override per call).
DEFAULT_MAX_ARRAY_BYTES = 8 * 1024**3


class InputFileError(ValueError):
    """A file could not be read as the expected format. The message names the file and the field."""


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; rename it over ``path`` on success.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise InputFileError(f"cannot write {target}: folder {folder} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        with contextlib.suppress(OSError):  # make the rename durable where the OS allows it
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_write(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj, indent: int | None = 1) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_save_npz(path, compress: bool = True, **arrays) -> None:
    """``np.savez`` into a temporary file, then rename. No object arrays (no pickle)."""
    for k, v in arrays.items():
        if np.asarray(v).dtype == object:
            raise ValueError(f"array {k!r} has dtype object; only numeric and string arrays are written")
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


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
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: no such file")
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
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: no such file")
    size = p.stat().st_size
    if size > max_bytes:
        raise InputFileError(f"{p}: {size} bytes is over the {max_bytes}-byte limit for a JSON file")
    try:
        return json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(
            f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputFileError(f"{p}: JSON nested too deeply") from None


def iter_npz_array_chunks(path: str | os.PathLike, key: str, chunk_rows: int = 65536) -> Iterator[np.ndarray]:
    """Stream one array of an ``.npz`` along its first axis without loading it whole.

    Works for compressed and stored members (zipfile decompresses as it reads). Memory is bounded by
    ``chunk_rows`` rows. Object arrays are refused.

    Yields:
        arrays ``[<= chunk_rows, *shape[1:]]`` in order.
    """
    p = Path(path)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
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


def safe_torch_load(path: str | os.PathLike, max_bytes: int, what: str = "a .pt file"):
    """``torch.load(weights_only=True)`` with a size check; torch is imported lazily.

    Only tensors, dicts, lists and numbers are loaded, never pickled objects. Any failure becomes an
    :class:`InputFileError` naming the file.
    """
    p = Path(path)
    size = p.stat().st_size
    if size > max_bytes:
        raise InputFileError(f"{p}: {size} bytes is over the {max_bytes}-byte limit for {what}")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional extra
        raise InputFileError(
            f"{p}: reading {what} needs torch (pip install 'moe-placement[torch]')"
        ) from None
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError (bad zip), EOFError, ...
        raise InputFileError(
            f"{p}: not a safe torch.save file ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
            f"only tensors, dicts, lists and numbers are loaded, never pickled objects"
        ) from None
