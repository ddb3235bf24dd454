"""The one writer: every file or directory a ``quantreg`` command creates or replaces goes through here.

Why one writer: each command used to write its own way, and each got one of the same faults.
``tune --out /dev/null`` ``os.replace``-d its temporary file over the device node (as root: the
node deleted, a 0600 YAML file in its place; a FIFO or a socket went the same way);
``new-plugin NAME /proc/x`` and ``tiny-model /proc/x`` ended in a traceback from ``mkdir``;
``tiny-model ''`` wrote into the current directory. So:

- :func:`file_target_problem` / :func:`dir_target_problem` say why a target cannot be written,
  BEFORE any work (minutes of ``tune`` measuring, torch imports): an existing target must be a
  regular file (or, for a directory output, a directory); device nodes, FIFOs, sockets and, where
  not documented, symlinks are refused, as are an empty name and a parent that cannot hold it.
- :func:`replace_file` writes a temporary file in the target's own directory (same file system),
  fsyncs it and renames it over the target: readers see the old file or the new one, never a
  part; on any failure (``KeyboardInterrupt`` included) the temporary file is removed.
- :func:`replace_directory` fills a fresh temporary directory beside the target, then renames it
  into place (the old one, with ``force``, moved aside first and removed without following links).
- :func:`write_new` creates one file that must not exist yet (``O_EXCL``: never through a planted
  symlink), for writers filling a directory :func:`replace_directory` just created.

Every ``OSError``/``ValueError`` becomes :class:`~quantreg.files.WriteRefused` with a short reason.
``tests/test_writing.py`` walks quantreg's code for any other write (``open(..., 'w')``,
``write_text``, ``os.replace``, ``shutil``, ``mkdir``...) outside this module and the stated allow-list.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .files import WriteRefused, kind
from .problems import printable

_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ValueError):
        return "the path contains a NUL character" if "null" in str(exc).lower() else str(exc)[:100]
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


def _lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is a file: the parent check names it


def _parent_problem(target: Path, create_parents: bool) -> str | None:
    """Why the directory that will hold ``target`` cannot (``None``: it can)."""
    parent = target.parent
    probe = parent
    while True:  # the nearest existing ancestor decides (with create_parents the rest is created)
        try:
            st = os.stat(probe)
            break
        except FileNotFoundError:
            if not create_parents:
                return f"its directory {printable(str(parent))} does not exist"
        except NotADirectoryError:
            return f"a part of {printable(str(parent))} is not a directory"
        except (OSError, ValueError) as exc:
            return f"its directory {printable(str(parent))} cannot be used: {_reason(exc)}"
        if probe.parent == probe:
            return f"its directory {printable(str(parent))} cannot be created"
        probe = probe.parent
    if not stat.S_ISDIR(st.st_mode):
        return f"{printable(str(probe))} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"its directory {printable(str(probe))} is not writable"
    try:  # access() says yes to root on /proc and /sys: create (and remove) one file to be sure, before any work
        fd, name = tempfile.mkstemp(prefix=".quantreg-probe.", dir=probe)
    except (OSError, ValueError) as exc:
        return f"no file can be created in {printable(str(probe))}: {_reason(exc)}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _named(path: str | os.PathLike[str]) -> Path | str:
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        return "an empty name; expected a path"
    if "\0" in text:
        return "the path contains a NUL character"
    return Path(os.path.abspath(text))  # "." and "dir/" name their directory, never an empty last part


def _looked_up(path: str | os.PathLike[str]) -> tuple[Path, os.stat_result | None] | str:
    """The absolute target ``path`` names and what is there now (``lstat``; ``None``: nothing), or why
    the name itself is unusable: the opening of every target check."""
    target = _named(path)
    return target if isinstance(target, str) else (target, _lstat(target))


def file_target_problem(path: str | os.PathLike[str], *, replace_symlink: bool = False) -> str | None:
    """Why ``path`` cannot receive a file (``None``: it can). Checked before the command does any work.

    An existing target must be a regular file; a symlink is refused unless ``replace_symlink``
    (then the link itself is replaced, never followed: the rename swaps the name).
    """
    found = _looked_up(path)
    if isinstance(found, str):
        return found
    target, st = found
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            if not replace_symlink:
                return "is a symlink; expected a regular file or a new name (nothing was written)"
        elif stat.S_ISDIR(st.st_mode):
            return "is a directory; expected a file name"
        elif not stat.S_ISREG(st.st_mode):
            return f"is {kind(st.st_mode)}; expected a regular file or a new name (it is never replaced)"
    return _parent_problem(target, create_parents=False)


def dir_target_problem(path: str | os.PathLike[str], *, force: bool = False, replace_symlink: bool = False,
                       has_force: bool = True) -> str | None:
    """Why ``path`` cannot become a directory the command fills (``None``: it can).

    New, or an existing empty directory; a non-empty one only with ``force``; a symlink only with
    ``replace_symlink`` (and ``force`` when it names anything). Missing parents are created later,
    so only the nearest existing ancestor must be a writable directory. ``has_force``: the command
    has a ``--force`` to suggest.
    """
    found = _looked_up(path)
    if isinstance(found, str):
        return found
    target, st = found
    if st is not None and stat.S_ISLNK(st.st_mode):
        if not replace_symlink or not os.path.isdir(target):
            return "is a symlink; expected a new or empty directory (nothing was written)"
        if not force:
            return "is a symlink to a directory; pass --force to replace it (nothing was written)"
    elif st is not None and not stat.S_ISDIR(st.st_mode):
        what = "an existing file" if stat.S_ISREG(st.st_mode) else kind(st.st_mode)
        return f"is {what}; expected a new or empty directory (nothing was written)"
    elif st is not None:
        try:
            empty = not any(os.scandir(target))
        except OSError as exc:
            return f"cannot be listed: {_reason(exc)}"
        if not empty and not force:
            hint = "pass --force to replace its contents" if has_force else "choose a new or empty directory"
            return f"is not empty; {hint} (nothing was written)"
    return _parent_problem(target, create_parents=True)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # the rename itself durable where the platform allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_file(path: str | os.PathLike[str], data: str | bytes, *, replace_symlink: bool = False,
                 mode: int = 0o644) -> Path:
    """Create or replace ``path`` with ``data`` in one step; :class:`WriteRefused` when it cannot.

    Checked again here (something may have appeared since the command's first check), then a
    temporary file in the same directory, fsync, ``os.replace``. Nothing is left on failure.
    """
    problem = file_target_problem(path, replace_symlink=replace_symlink)
    if problem is not None:
        raise WriteRefused(problem)
    target = Path(os.path.abspath(os.fspath(path)))
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"cannot create a file in {printable(str(target.parent))}: {_reason(exc)}") from None
    try:
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except (OSError, ValueError) as exc:
            raise WriteRefused(f"cannot write: {_reason(exc)}") from None
    except BaseException:  # KeyboardInterrupt included: no partial file, no stray temporary file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def write_new(path: str | os.PathLike[str], data: str | bytes, *, mode: int = 0o644) -> Path:
    """Create ``path``, which must not exist (``O_EXCL``, no symlink followed), holding ``data``.

    For writers filling a directory made fresh by :func:`replace_directory` or a temporary one:
    nothing in it can be a planted link or device, so one create-exclusive write is enough.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(path, _NEW_FLAGS, mode)
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"{printable(os.fspath(path))}: cannot create: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise WriteRefused(f"{printable(os.fspath(path))}: cannot write: {_reason(exc)}") from None
    return Path(path)


def make_directory(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` for a directory quantreg writes into; :class:`WriteRefused` (not a traceback) when it cannot."""
    try:
        os.makedirs(path, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"{printable(os.fspath(path))}: cannot create the directory: {_reason(exc)}") from None
    return Path(path)


def fresh_directory(prefix: str, parent: str | os.PathLike[str] | None = None) -> Path:
    """A new private directory (``mkdtemp``), for scratch work and for :func:`replace_directory`."""
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"cannot create a directory in {printable(os.fspath(parent or tempfile.gettempdir()))}: "
                           f"{_reason(exc)}") from None


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory quantreg made (never follows symlinks out of it); silent when already gone."""
    shutil.rmtree(path, ignore_errors=True)


def replace_directory(path: str | os.PathLike[str], fill: Callable[[Path], object], *, force: bool = False,
                      replace_symlink: bool = False, has_force: bool = True) -> Path:
    """Make ``path`` a directory holding what ``fill(fresh)`` writes, in one rename.

    ``fill`` writes into a new temporary directory beside the target (nothing in it can be a
    planted symlink); the target is checked again, the old one (``force``) moved aside, the new
    one renamed into place and the old one removed. Any failure removes the temporary directory
    and leaves the target as it was.
    """
    problem = dir_target_problem(path, force=force, replace_symlink=replace_symlink, has_force=has_force)
    if problem is not None:
        raise WriteRefused(problem)
    target = Path(os.path.abspath(os.fspath(path)))
    created = [p for p in (target.parent, *target.parent.parents) if not os.path.lexists(p)]
    make_directory(target.parent)
    try:
        fresh = fresh_directory(f".{target.name}.", target.parent)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        fill(fresh)
        again = dir_target_problem(target, force=force, replace_symlink=replace_symlink, has_force=has_force)
        if again is not None:
            raise WriteRefused(again)
        aside = None
        try:
            if os.path.lexists(target):
                aside = fresh_directory(f".{target.name}.old.", target.parent)
                os.rename(target, aside / "old")
            os.rename(fresh, target)
        except OSError as exc:
            raise WriteRefused(f"cannot move the new directory into place: {_reason(exc)}") from None
        if aside is not None:
            remove_tree(aside)
    except BaseException:
        remove_tree(fresh)
        _remove_empty(created)  # parents this call created: nothing left on failure
        raise
    return target


def _remove_empty(directories: list[Path]) -> None:
    """Remove the (still empty) directories a failed write created, deepest first."""
    for directory in directories:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def open_log(path: str | os.PathLike[str]) -> BinaryIO:
    """A log file for a child process's output, truncated (created if missing); never a device or FIFO.

    Why a handle, not :func:`replace_file`: a subprocess writes it while it runs. The target is
    checked like any file target (a symlink is refused), then opened without following a link.
    """
    problem = file_target_problem(path)
    if problem is not None:
        raise WriteRefused(f"{printable(os.fspath(path))}: {problem}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise WriteRefused(f"{printable(os.fspath(path))}: is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "wb")
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"{printable(os.fspath(path))}: cannot open: {_reason(exc)}") from None
