"""The one bounded, non-blocking way quantreg opens a file for reading, and the one for appending.

Why one way: every path quantreg opens comes from outside (the environment, a plugin, a
checkpoint directory, a table) and may name a FIFO, a terminal, ``/dev/stdin`` on a silent pipe
or ``/dev/zero``. ``st_size`` says nothing about those (0), and a blocking ``open`` of a FIFO
waits forever for the other end: ``QUANTREG_DECISIONS`` naming a FIFO with no reader used to
block every vLLM process at its first MoE layer, ``plan`` hung on a ``config.json`` that was a
FIFO. So a path is stat'ed first (devices are refused without opening them), opened with
``O_NONBLOCK``, the *open descriptor* is checked again (no race with a rename), only a regular
file is read or appended to, and never more than a cap. Every ``OSError``/``ValueError`` a
path can raise becomes :class:`ReadRefused` / :class:`WriteRefused` with a short reason.

``tests/test_files.py`` walks quantreg's code for any other ``open(``/``read_text``/``read_bytes``.
"""

from __future__ import annotations

import errno
import os
import stat

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
CHUNK = 1 << 20


class ReadRefused(Exception):
    """A path that is not read: the message says why (no such file, not a regular file, too big...)."""


class WriteRefused(Exception):
    """A path that is not appended to: the message says why (not a regular file, too big, unwritable...)."""


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a plain file"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ValueError):  # an embedded NUL, or a name the file system encoding cannot express
        return "the path contains a NUL character" if "null" in str(exc).lower() else str(exc)[:100]
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return type(exc).__name__


def read_regular(path: str | os.PathLike[str], cap: int, *, expected: str = "a regular file",
                 noun: str = "the file", head: bool = False) -> bytes:
    """The bytes of a regular file of at most ``cap`` bytes; :class:`ReadRefused` for anything else.

    ``head=True`` reads the first ``cap`` bytes of a file of any size (a safetensors header of a
    multi-GB shard). ``expected`` and ``noun`` word the refusals ("expected a YAML file", "a table
    may have at most N").
    """
    try:
        try:
            before = os.stat(path)  # no side effect on devices: refuse them without opening
        except FileNotFoundError:
            raise ReadRefused("no such file") from None
        if stat.S_ISDIR(before.st_mode):
            raise ReadRefused(f"is a directory; expected {expected}")
        if not stat.S_ISREG(before.st_mode):
            raise ReadRefused(f"is not a regular file ({kind(before.st_mode)}); expected {expected}")
        fd = os.open(path, _READ_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ReadRefused(f"is not a regular file ({kind(st.st_mode)}); expected {expected}")
            if st.st_size > cap and not head:
                raise ReadRefused(f"file is {st.st_size} bytes; {noun} may have at most {cap}")
            chunks: list[bytes] = []
            total = 0
            limit = cap if head else cap + 1
            while total < limit:
                chunk = os.read(fd, min(CHUNK, limit - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > cap:  # the file grew since fstat (or lies about its size)
                raise ReadRefused(f"file is more than {cap} bytes; {noun} may have at most {cap}")
            return b"".join(chunks)
        finally:
            os.close(fd)
    except ReadRefused:
        raise
    except FileNotFoundError:
        raise ReadRefused("no such file") from None
    except (OSError, ValueError) as exc:
        raise ReadRefused(f"cannot read: {_reason(exc)}") from None


def require_regular(path: str | os.PathLike[str], *, expected: str = "a regular file") -> None:
    """Refuse (:class:`ReadRefused`) a path that is not a regular file, before a library opens it.

    Why: some files are opened by a library, not by :func:`read_regular` (safetensors shards,
    which ``safe_open`` memory-maps): a FIFO there blocks that library's ``open`` forever, a
    symlink to ``/dev/zero`` maps an endless file. Symlinks to regular files are followed.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ReadRefused("no such file") from None
    except (OSError, ValueError) as exc:
        raise ReadRefused(f"cannot read: {_reason(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ReadRefused(f"is not a regular file ({kind(st.st_mode)}); expected {expected}")


def append_regular(path: str | os.PathLike[str], data: bytes, cap: int) -> None:
    """Append ``data`` with ONE ``os.write`` to a regular file (created if missing) of at most ``cap`` bytes.

    Never blocks: a FIFO with no reader is refused by the kernel (``ENXIO`` with ``O_NONBLOCK``),
    one with a reader and every device by the checks; a file already over ``cap`` is refused
    (a trail must not fill the disk). A short write is reported, never retried (a retry would no
    longer be one atomic append).
    """
    try:
        try:
            before = os.stat(path)
        except FileNotFoundError:
            before = None
        if before is not None and not stat.S_ISREG(before.st_mode):
            raise WriteRefused(f"is not a regular file ({kind(before.st_mode)}); expected a file to append to")
        try:
            fd = os.open(path, _APPEND_FLAGS, 0o644)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise WriteRefused("is a FIFO with no reader; expected a file to append to") from None
            raise WriteRefused(f"cannot open: {_reason(exc)}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WriteRefused(f"is not a regular file ({kind(st.st_mode)}); expected a file to append to")
            if st.st_size + len(data) > cap:
                raise WriteRefused(f"is {st.st_size} bytes; appending would pass the cap of {cap} bytes")
            try:
                written = os.write(fd, data)
            except OSError as exc:
                raise WriteRefused(f"cannot write: {_reason(exc)}") from None
        finally:
            os.close(fd)
    except WriteRefused:
        raise
    except (OSError, ValueError) as exc:
        raise WriteRefused(f"cannot append: {_reason(exc)}") from None
    if written != len(data):
        raise WriteRefused(f"short write ({written} of {len(data)} bytes); the last line is cut")


def inside(root: str | os.PathLike[str], name: str) -> str | None:
    """``root/name`` when ``name`` is a plain relative path that stays inside ``root`` (links resolved), else None.

    Why: a checkpoint's index names its shards; ``../elsewhere/x.safetensors`` or an absolute
    path must never make quantreg read outside the checkpoint the user named.
    """
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return None
    try:
        base = os.path.realpath(root)
        target = os.path.realpath(os.path.join(base, name))
    except (OSError, ValueError):
        return None
    return target if os.path.commonpath([base, target]) == base and target != base else None
