"""Writing the files a command was asked to write, without destroying what a path points at.

Every command that writes (rewrite -o/--report, run --outputs, bench --json) checks all its
output locations with ``check`` before any work starts, then writes through ``OutputFile.write``:

- a regular file (or a new one) is replaced atomically: a temporary file in the same directory,
  then a rename; a reader never sees half a file and a failed write keeps the old content.
  An existing file keeps its permission bits, a new one gets 0666 minus the umask (as the shell
  would create it). Hard links to the old file keep the old content.
- a character device or FIFO (/dev/null, /dev/stdout, a named pipe) is opened and written in
  place, like the shell's ``>``: renaming over it would replace the node with a regular file.
- a symbolic link is followed: the bytes go to its final target and the link stays a link.
- sockets, block devices, directories, read-only files, missing directories, an output that is
  one of the command's inputs, and two outputs naming one file are refused with a UsageError.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import stat
import tempfile
from typing import Iterable, Optional, Sequence

from flashgen.errors import FlashgenError, UsageError

_MAX_LINKS = 40  # the kernel's own limit on a symlink chain (ELOOP)


@dataclasses.dataclass(frozen=True)
class OutputFile:
    flag: str        # the option that named it, for messages ("-o", "--report", ...)
    path: str        # as the user gave it
    target: str      # where the bytes go: symlinks followed
    in_place: bool   # a device or FIFO: opened and written, never replaced
    make_dirs: bool = False

    def write(self, data: bytes) -> None:
        try:
            self._write(data)
        except OSError as e:  # ENOSPC, EIO ... name the file: the errno alone does not
            kept = "" if self.in_place else "; its old content is kept"
            raise FlashgenError(f"{self.flag} {self.path}: cannot write: "
                                f"{e.strerror or e}{kept}") from e

    def _write(self, data: bytes) -> None:
        if self.in_place:
            with open(self.path, "wb") as f:
                f.write(data)
            return
        target = pathlib.Path(self.target)
        if self.make_dirs:
            target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)


def check(outputs: Iterable[tuple[str, Optional[str]]], inputs: Sequence[str] = (), *,
          make_dirs: bool = False) -> list[Optional[OutputFile]]:
    """One OutputFile per (flag, path) — None where path is None — after checking them all.

    ``inputs`` are files the command reads: no output may be one of them. With ``make_dirs``
    a missing directory is created at write time (nothing is created here)."""
    planned = [None if path is None else _plan(flag, str(path), make_dirs)
               for flag, path in outputs]
    seen: dict = {}
    for out in planned:
        if out is None or out.in_place:
            continue
        for src in inputs:
            if same_file(out.target, src):
                raise UsageError(f"{out.flag} {out.path} is the input {src}: flashgen never "
                                 "overwrites its input; write to another path")
        key = _identity(out.target)
        if key in seen:
            raise UsageError(f"{seen[key].flag} and {out.flag} name the same file {out.path}")
        seen[key] = out
    return planned


def check_directory(flag: str, path: str) -> None:
    """A directory that files will be written into: an existing writable directory, or one
    that can be created (its nearest existing ancestor is a writable directory)."""
    d = pathlib.Path(path)
    if d.exists() and not d.is_dir():
        raise UsageError(f"{flag}: {path} is not a directory")
    if not _creatable(d):
        raise UsageError(f"{flag}: cannot create or write into the directory {path}")


def _plan(flag: str, path: str, make_dirs: bool) -> OutputFile:
    if not path:
        raise UsageError(f"{flag}: an empty path")
    target, magic = _follow(flag, path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"{flag}: cannot use {path}: {e.strerror}") from None
    if magic or (st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode))):
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag}: {path} is not writable")
        return OutputFile(flag, path, path, True)
    if st is not None:
        kind = _refused_kind(st.st_mode)
        if kind:
            raise UsageError(f"{flag}: {path} is {kind}")
        # no write bit is refused even for root, who could replace it: read-only is a request
        if not os.access(target, os.W_OK) or not st.st_mode & stat.S_IWUSR:
            raise UsageError(f"{flag}: {path} is read-only")
    parent = pathlib.Path(target).parent
    if not parent.is_dir():
        if make_dirs and _creatable(parent):
            return OutputFile(flag, path, target, False, True)
        raise UsageError(f"{flag}: the directory {parent} of {path} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: the directory {parent} is not writable")
    return OutputFile(flag, path, target, False)


def _follow(flag: str, path: str) -> tuple[str, bool]:
    """The final target of a symlink chain, and whether the chain runs through a /proc magic
    link (/dev/stdout -> /proc/self/fd/1): such a path is written in place, as the shell would,
    because its 'target' is an open file description, not a name to replace."""
    p = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        if p.startswith("/proc/"):
            return p, True
        if not os.path.islink(p):
            return p, False
        link = os.readlink(p)
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    raise UsageError(f"{flag}: {path}: too many levels of symbolic links")


def _refused_kind(mode: int) -> Optional[str]:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device (refusing to write a file onto a disk)"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return None


def _creatable(directory: pathlib.Path) -> bool:
    for d in (directory, *directory.parents):
        if d.exists():
            return d.is_dir() and os.access(d, os.W_OK | os.X_OK)
    return False


def _identity(path: str):
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return os.path.realpath(path)


def same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _umask() -> int:
    # os.umask can only be read by setting it; the CLI is single-threaded when it writes
    old = os.umask(0o022)
    os.umask(old)
    return old
