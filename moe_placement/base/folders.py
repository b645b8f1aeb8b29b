"""Output folders that hold one run's files, whole: the one mechanism every command that writes a folder
uses (``layout --output``, ``advise --output``, ``inspect --plot``, ``demo --out``; ``solve --failover``
and ``plan --output`` are wired to it the same way).

A command claims its folder before it computes anything and publishes its files at the end::

    with claim_folder(out, "layout", POSSIBLE_NAMES) as claim:   # refused here, before any work
        files = compute()                                        # {name: bytes}
        claim.publish(files)                                     # the folder is now this run's

- one run's files: beside the files, ``.moe-placement-manifest.json`` (:data:`MANIFEST`) names the
  command and each file's SHA-256. :meth:`FolderClaim.publish` makes the folder this run's files so
  far: the files given replace theirs, every file the previous manifest (of the same command) listed
  that this run has not written is removed, and the manifest is rewritten. A run that writes fewer
  files than the last therefore leaves none of the last run's beside its own.
- published as a unit: every file goes to an fsynced temporary sibling first; the renames, the
  removals and the manifest then happen with SIGINT/SIGTERM/SIGHUP deferred, each replaced or removed
  file kept aside (a hard link) until all have succeeded. A failure half-way puts every file back: the
  previous run's folder, whole. Only SIGKILL or a power cut can leave a mix, which the manifest's
  checksums then show.
- never touches a file it did not write: a file of the folder that one of the claimed names would
  replace, or that the manifest lists, must be a regular file with the checksum the manifest of the
  same command recorded; a folder whose manifest is another command's is refused whole. Other files
  are left alone.
- one run at a time: the claim holds an exclusive ``flock`` on the folder until it ends, so a second
  run is refused at once (one line) instead of computing and then overwriting the first one's folder.
- nothing written on a refusal: the claim creates the folder when missing (and removes it again, if
  still empty, when the run ends without publishing), and checks that a file can be created in it.

Every refusal is an :class:`~moe_placement.base.errors.InputFileError` (a ValueError: the CLI prints
one line and exits 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import string
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from moe_placement.base.errors import InputFileError
from moe_placement.base.fileio import (
    _fsync_folder,
    _temp_file,
    _temp_tag,
    check_writable_folder,
    deferred_signals,
    load_json,
)

try:  # POSIX: the lock that refuses a concurrent run
    import fcntl
except ImportError:  # pragma: no cover - elsewhere two runs are not refused (each still publishes whole)
    fcntl = None

__all__ = ["MANIFEST", "MANIFEST_SCHEMA", "FolderClaim", "claim_folder", "publish_folder"]

MANIFEST = ".moe-placement-manifest.json"
MANIFEST_SCHEMA = "moe-placement/output-folder"
MANIFEST_VERSION = 1
_MAX_MANIFEST_BYTES = 1 << 20
_COMMAND_CHARS = set(string.ascii_lowercase + string.digits + "-")


def _check_name(name: object, where: str) -> str:
    """``name`` when it is a plain file name of the folder (no path, not hidden), else a ValueError."""
    ok = isinstance(name, str) and 0 < len(name) <= 255 and not name.startswith(".")
    if not ok or any(ch in name for ch in "/\\\0"):  # type: ignore[operator]
        raise InputFileError(
            f"{where}: {name!r} is not a plain file name (no folders, not starting with '.'); "
            f"output folders hold named files only"
        )
    return name  # type: ignore[return-value]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(folder: Path) -> tuple[str, dict[str, str]] | None:
    """``(command, {name: sha256})`` of the folder's manifest, None when it has none."""
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return None
    fix = f"remove {path} (and the files it lists) if the folder is yours, or choose another folder"
    data = load_json(path, max_bytes=_MAX_MANIFEST_BYTES)
    if not (isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA):
        raise InputFileError(f"{path}: not a moe-placement output-folder manifest; {fix}")
    command, files = data.get("command"), data.get("files")
    version = data.get("version")
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise InputFileError(f"{path}: manifest version {version!r} is not one this version reads; {fix}")
    hex_ok = lambda v: isinstance(v, str) and len(v) == 64 and set(v) <= set(string.hexdigits)  # noqa: E731
    if not isinstance(command, str) or not isinstance(files, dict) or not all(map(hex_ok, files.values())):
        raise InputFileError(f"{path}: the manifest's 'command' or 'files' is malformed; {fix}")
    for name in files:
        _check_name(name, str(path))  # a hostile manifest never names a file outside the folder
    return command, dict(files)


def _owned(folder: Path, command: str, names: frozenset[str]) -> dict[str, str]:
    """The files the folder's manifest lists (``{name: sha256}``), after refusing a folder this run would
    take from someone else: another command's manifest, or a file that a claimed name would replace
    or the manifest lists which is not, byte for byte, what an earlier run of ``command`` wrote."""
    found = _read_manifest(folder)
    if found is not None and found[0] != command:
        listed = ", ".join(sorted(found[1])[:4]) + (" ..." if len(found[1]) > 4 else "")
        raise InputFileError(
            f"output folder {folder} holds the files of a `{found[0]}` run ({listed}); an output folder "
            f"holds one run's files: write the {command} output to another folder, or empty this one"
        )
    previous = found[1] if found else {}
    for name in sorted(names | set(previous)):
        path = folder / name
        if not os.path.lexists(path):
            continue
        if name not in previous:
            raise InputFileError(
                f"output folder {folder} already holds {name}, which no earlier `{command}` run wrote "
                f"there (no manifest lists it); move it away, or choose another folder"
            )
        if not stat.S_ISREG(os.lstat(path).st_mode) or _sha256(path) != previous[name]:
            raise InputFileError(
                f"{path} was changed since the `{command}` run that wrote it (not the file its manifest "
                f"records); move it away, or choose another folder"
            )
    return previous


class FolderClaim:
    """A claimed output folder (:func:`claim_folder`): :meth:`publish` writes into it.

    Attributes:
        folder: the folder. command: the command whose files it holds. names: the file names it may get.
        published: ``{name: sha256}`` of the files this run has published so far.
    """

    def __init__(self, folder: Path, command: str, names: frozenset[str], previous: dict[str, str]):
        self.folder, self.command, self.names = folder, command, names
        self.published: dict[str, str] = {}
        self._previous = previous

    def publish(self, files: Mapping[str, bytes]) -> list[Path]:
        """Make the folder this run's files so far, as one step (the module docstring): ``files``
        (``{name: bytes}``, names among the claimed ones) written, the previous run's other files
        removed, the manifest rewritten. Returns the paths written, in the order given."""
        data = {_check_name(n, f"{self.command} output"): bytes(b) for n, b in files.items()}
        unclaimed = sorted(set(data) - self.names)
        if unclaimed:
            raise ValueError(f"publish: {unclaimed} are not among the names claimed for {self.folder}")
        published = {**self.published, **{n: hashlib.sha256(b).hexdigest() for n, b in data.items()}}
        stale = [n for n in self._previous if n not in published and os.path.lexists(self.folder / n)]
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "version": MANIFEST_VERSION,
            "command": self.command,
            "files": dict(sorted(published.items())),
        }
        text = json.dumps(manifest, indent=1) + "\n"
        _swap_in(self.folder, {**data, MANIFEST: text.encode()}, stale)
        self.published = self._previous = published
        return [self.folder / n for n in data]


@contextlib.contextmanager
def claim_folder(folder: str | os.PathLike, command: str, names: Iterable[str]) -> Iterator[FolderClaim]:
    """Claim ``folder`` for one run of ``command`` that may write the files ``names``; the claim lasts
    while the block runs (see the module docstring for what is refused).

    Raises:
        InputFileError: the path is a file; the folder cannot be created or written in; another run
            holds it; it holds another command's files, or files this command did not write.
    """
    if not isinstance(command, str) or not command or not set(command) <= _COMMAND_CHARS:
        raise ValueError(f"command must be a command name such as 'layout', got {command!r}")
    out = Path(folder)
    claimed = frozenset(_check_name(n, f"{command} output") for n in names)
    created = _make_folder(out)
    claim = None
    try:
        with _locked(out):
            check_writable_folder(out, f"output folder {out}")
            claim = FolderClaim(out, command, claimed, _owned(out, command, claimed))
            yield claim
    finally:
        if claim is None or not claim.published:
            _remove_empty(created)


def publish_folder(folder: str | os.PathLike, files: Mapping[str, bytes], command: str) -> list[Path]:
    """Claim ``folder`` for ``command`` and publish ``files`` (``{name: bytes}``) at once: the
    one-call form of :func:`claim_folder` for a run that has its files before it touches the folder."""
    with claim_folder(folder, command, files) as claim:
        return claim.publish(files)


def _make_folder(out: Path) -> list[Path]:
    """Create ``out`` (and missing parents); the folders created, deepest first."""
    if os.path.lexists(out) and not out.is_dir():
        raise InputFileError(f"output folder {out} exists and is not a folder; give a folder path")
    created, p = [], out
    while not os.path.lexists(p) and p != p.parent:
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputFileError(
            f"cannot create output folder {out} ({exc.strerror or exc}); choose another folder"
        ) from None
    return created


def _remove_empty(created: list[Path]) -> None:
    for p in created:  # deepest first; a folder something was written into stays
        try:
            p.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """An exclusive, non-blocking ``flock`` on the folder for the block; refused when another run holds it."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputFileError(
                f"output folder {out} is being written by another moe-placement run right now (it holds "
                f"the folder's lock); wait for that run to end, or choose another folder"
            ) from None
        except OSError:  # a file system without locks: the run goes on unlocked
            pass
        yield
    finally:
        os.close(fd)


def _aside_name(target: Path) -> Path:
    """A unique hidden sibling of ``target`` that :func:`moe_placement.base.fileio.clean_stale_temps`
    removes if a killed run leaves it."""
    return target.parent / f".{target.name}.{_temp_tag()}.{uuid.uuid4().hex[:8]}.tmp"


def _keep_aside(target: Path, move: bool) -> Path | None:
    """A copy of ``target`` kept until the publish succeeds (``move``: renamed away, for a file to be
    removed; else hard-linked, or copied where links are refused); None when it does not exist."""
    if not os.path.lexists(target):
        return None
    aside = _aside_name(target)
    if move:
        os.replace(target, aside)
        return aside
    try:
        os.link(target, aside, follow_symlinks=False)
    except OSError:
        shutil.copy2(target, aside, follow_symlinks=False)
    return aside


def _swap_in(folder: Path, files: dict[str, bytes], stale: list[str]) -> None:
    """Write ``files`` and remove ``stale`` as one step: temporary files first, then renames with the
    old files kept aside, which are put back when any step fails (then re-raised)."""
    pairs: list[tuple[str, Path]] = []
    undo: list[tuple[Path, Path | None]] = []  # (target, what to put back: None = remove the target)
    try:
        for name, data in files.items():
            with _temp_file(folder / name) as (fh, tmp):
                fh.write(data)
            pairs.append((tmp, folder / name))
        with deferred_signals():
            for tmp, target in pairs:
                aside = _keep_aside(target, move=False)
                undo.append((target, aside))
                os.replace(tmp, target)
            for name in stale:
                undo.append((folder / name, _keep_aside(folder / name, move=True)))
    except BaseException:
        _put_back(undo)
        for tmp, _ in pairs:  # a renamed one no longer exists under its temporary name
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    for _, aside in undo:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.unlink(aside)
    _fsync_folder(folder)


def _put_back(undo: list[tuple[Path, Path | None]]) -> None:
    """Undo :func:`_swap_in`'s renames, last first: each target back to what was kept aside, or removed."""
    with deferred_signals():
        for target, aside in reversed(undo):
            with contextlib.suppress(OSError):
                if aside is None:
                    os.unlink(target)
                else:
                    os.replace(aside, target)
