"""The on-disk kernel cache: layout, integrity records, verification and repair.

Layout (root: $FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen, else ~/.cache/flashgen):

    objects/<key>.o        one compiled source (a CUDA one with its PTX: objects/<key>.ptx)
    objects/<key>.json     its record {"size", "sha256", "companions": {".ptx": {...}}}, written
                           after the files it describes: an object without a matching record
                           is no entry
    runtime/<key>.so       flashgen.emulate's stand-in CUDA runtime, with its record
                           runtime/<key>.json like an object's
    libs/<key>/            one library: lib*.so, manifest.json, src/ (the rendered sources,
                           for reading). The manifest records the size and sha256 of the .so
                           and a digest of itself.
    locks/<key>.lock       flock per key: concurrent builds of one key compile it once (an
                           exclusive lock, which names its holder in the file), a held lock
                           marks that key's staging files as live, and a build holds a shared
                           lock on every object it links until it has linked: `clean` skips both

Entries appear atomically (os.replace of a finished file or directory) and are verified before
use: a truncated, altered or half-deleted entry is reported and rebuilt, never loaded. Staging
(`.tmp-<key>-*` under libs/, objects/ and runtime/) left by a killed build is removed by the next build or
`flashgen cache clean` once no process holds that key's lock. Files are created with the
process's umask (no forced private modes), so a cache or an exported library can be shared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import pathlib
import secrets
import shutil
import stat
import time
from typing import Callable

from flashgen.errors import FlashgenError

log = logging.getLogger("flashgen.cache")
MANIFEST = "manifest.json"
STAGING_PREFIX = ".tmp-"
_SELF_DIGEST = "manifest_sha256"


class CacheError(FlashgenError):
    """The cache directory cannot be used as asked (not a directory, read-only, a planted lock)."""


class CorruptEntry(Exception):
    """A cache entry or shipped library does not match its records; the message says how."""


class OutdatedEntry(CorruptEntry):
    """An entry written by an older flashgen, without integrity records: never used, not damaged."""


def root() -> pathlib.Path:
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if env:
        path, origin = pathlib.Path(env).expanduser(), "FLASHGEN_CACHE_DIR"
    elif xdg:
        path, origin = pathlib.Path(xdg) / "flashgen", "XDG_CACHE_HOME"
    else:
        path, origin = _home() / ".cache" / "flashgen", "HOME"
    if path.exists() and not path.is_dir():
        raise CacheError(f"the cache {path} (from {origin}) is not a directory")
    return path


def _home() -> pathlib.Path:
    """$HOME; an empty or unset HOME (a stripped service environment) falls back to the account's
    home in the password database, said once, rather than to '/'."""
    home = os.environ.get("HOME")
    if home:
        return pathlib.Path(home)
    try:
        import pwd
        account = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        account = ""
    if account in ("", "/"):
        raise CacheError("HOME is empty and this account has no home directory: set "
                         "FLASHGEN_CACHE_DIR to choose where the kernel cache goes")
    _say_once(f"HOME is empty: the kernel cache is under {account} (this account's home); set "
              f"FLASHGEN_CACHE_DIR to choose another place")
    return pathlib.Path(account)


@functools.cache
def _say_once(message: str) -> None:
    log.warning(message)


def writable(cache: pathlib.Path) -> bool:
    """Whether entries can be added or removed (a read-only mount serves cached hits only)."""
    return not cache.exists() or os.access(cache, os.W_OK)


# ------------------------------------------------------------------------------ records
def file_record(path: pathlib.Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


# Files already hashed by this process, by identity and stat: a library loaded after its build's
# cache lookup is hashed once. Any write changes size or mtime and so invalidates its line.
_verified: dict[tuple, str] = {}


def check_file(path: pathlib.Path, record: dict) -> None:
    """Raise CorruptEntry unless `path` has the size and sha256 of `record`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CorruptEntry(f"{path.name} is missing") from None
    if not isinstance(record, dict) or "size" not in record or "sha256" not in record:
        raise CorruptEntry(f"no size/sha256 record for {path.name}")
    if st.st_size != record["size"]:
        raise CorruptEntry(f"{path.name} has {st.st_size} bytes, its record says {record['size']} "
                           f"(truncated or replaced)")
    stamp = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _verified.get(stamp) == record["sha256"]:
        return
    if file_record(path)["sha256"] != record["sha256"]:
        raise CorruptEntry(f"{path.name} does not match its sha256 record (altered bytes)")
    _verified[stamp] = record["sha256"]


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != _SELF_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(manifest: dict) -> str:
    """The manifest as JSON text carrying a digest of itself."""
    sealed = {**manifest, _SELF_DIGEST: _manifest_digest(manifest)}
    return json.dumps(sealed, indent=2, sort_keys=True) + "\n"


def read_manifest(path: pathlib.Path) -> dict:
    """A library's manifest, checked against its own digest; CorruptEntry if it is not intact."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CorruptEntry(f"{path.name} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"{path.name} cannot be read: {e}") from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise CorruptEntry(f"{path.name} is not valid JSON ({e}): truncated or altered") from None
    if not isinstance(manifest, dict) or "flashgen_library" not in manifest:
        raise CorruptEntry(f"{path.name} is not a flashgen manifest")
    if _SELF_DIGEST not in manifest or "files" not in manifest:
        raise OutdatedEntry(f"{path.name} has no integrity records (written by an older "
                            f"flashgen): rebuild the library")
    if manifest[_SELF_DIGEST] != _manifest_digest(manifest):
        raise CorruptEntry(f"{path.name} does not match its own digest (altered)")
    return manifest


def verify_library(directory: pathlib.Path) -> dict:
    """The manifest of the library in `directory` once the manifest and the shared library are
    verified against their records; CorruptEntry otherwise. Call before every dlopen."""
    manifest = read_manifest(directory / MANIFEST)
    name = manifest["flashgen_library"]
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise CorruptEntry(f"{MANIFEST} names an invalid library file {name!r}")
    check_file(directory / name, manifest["files"].get(name))
    for other, record in manifest["files"].items():  # e.g. the PTX an emulated library runs
        if other != name:
            if other.startswith(("/", ".")) or ".." in other.split("/"):
                raise CorruptEntry(f"{MANIFEST} names an invalid file {other!r}")
            check_file(directory / other, record)
    return manifest


# ------------------------------------------------------------------------------ files
# Single-file entries: a file and its record (its size, sha256 and those of its companions).
FILE_KINDS = {"object": ("objects", ".o"), "runtime": ("runtime", ".so")}


def object_path(cache: pathlib.Path, key: str, kind: str = "object") -> pathlib.Path:
    sub, suffix = FILE_KINDS[kind]
    return cache / sub / f"{key}{suffix}"


def _entry_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The file of an entry, its companions and its record (the record last)."""
    try:
        companions = json.loads(path.with_suffix(".json").read_text()).get("companions", {})
    except (OSError, ValueError, AttributeError):
        companions = {}
    return [path, *(path.with_suffix(s) for s in companions if _is_suffix(s)), path.with_suffix(".json")]


def _is_suffix(text: str) -> bool:
    return isinstance(text, str) and text.startswith(".") and text[1:].isalnum()


def lookup_object(cache: pathlib.Path, key: str, kind: str = "object",
                  companions: tuple[str, ...] = ()) -> pathlib.Path | None:
    """The verified entry of `key`, or None when absent, not matching its record or lacking one
    of `companions` (suffixes of files that must sit beside it, such as ".ptx")."""
    obj = object_path(cache, key, kind)
    try:
        _check_entry(obj, companions)
    except (OSError, ValueError, CorruptEntry):
        return None
    return obj


def _check_entry(obj: pathlib.Path, companions: tuple[str, ...] = ()) -> None:
    record = json.loads(obj.with_suffix(".json").read_text())
    check_file(obj, record)
    recorded = record.get("companions", {})
    for suffix in set(companions) - set(recorded):
        raise CorruptEntry(f"no record of its {suffix} file")
    for suffix, companion in recorded.items():
        if not _is_suffix(suffix):
            raise CorruptEntry(f"invalid companion {suffix!r} in its record")
        check_file(obj.with_suffix(suffix), companion)


def store_object(cache: pathlib.Path, key: str, tmp: pathlib.Path, kind: str = "object",
                 companions: dict[str, pathlib.Path] | None = None) -> pathlib.Path:
    """Move a freshly built file (and its companions, by suffix) into the cache with its record
    (caller holds the key's lock)."""
    obj = object_path(cache, key, kind)
    try:
        record = file_record(tmp)
    except FileNotFoundError:
        raise CorruptEntry(f"the compiler wrote no file for {key}") from None
    if record["size"] == 0:
        raise CorruptEntry(f"the compiler wrote an empty file for {key}")
    companions = companions or {}
    record["companions"] = {suffix: file_record(p) for suffix, p in companions.items()}
    record_tmp = temp_path(obj.parent, key, ".json")
    record_tmp.write_text(json.dumps(record) + "\n")
    for suffix, p in companions.items():
        os.replace(p, obj.with_suffix(suffix))
    os.replace(tmp, obj)
    os.replace(record_tmp, obj.with_suffix(".json"))  # last: the entry exists from here on
    return obj


# ------------------------------------------------------------------------------ staging
def temp_path(directory: pathlib.Path, key: str, suffix: str = "") -> pathlib.Path:
    """A fresh staging name for `key` in `directory` (not created: a compiler creates it)."""
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{STAGING_PREFIX}{key}-{secrets.token_hex(6)}{suffix}"


def staging_dir(directory: pathlib.Path, key: str) -> pathlib.Path:
    """A new empty staging directory for `key`, with the umask's mode (mkdtemp's is 0700)."""
    while True:
        path = temp_path(directory, key)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def discard(path: pathlib.Path) -> None:
    """Remove a bad entry: renamed to a staging name first, so that readers never see a
    half-deleted entry and a crash mid-way leaves only staging for clean_stale."""
    key = path.name.split(".", 1)[0]
    trash = temp_path(path.parent, key, ".bad")
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    _remove(trash)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _is_key(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def _staging_key(name: str) -> str | None:
    """The key a staging name belongs to (None: not staging, or an older flashgen's staging,
    which has no key to ask a lock about and is left to `flashgen cache clean`)."""
    if not name.startswith(STAGING_PREFIX):
        return None
    key = name[len(STAGING_PREFIX):].split("-", 1)[0]
    return key if _is_key(key) else None


def clean_stale(cache: pathlib.Path) -> list[pathlib.Path]:
    """Remove staging left by dead builds: those whose key's lock nobody holds."""
    removed = []
    if not writable(cache):  # a read-only cache serves hits; what it holds is not ours to clean
        return removed
    for sub in ("libs", *(d for d, _ in FILE_KINDS.values())):
        try:
            names = os.listdir(cache / sub)
        except OSError:
            continue
        for name in names:
            key = _staging_key(name)
            if key is None:
                continue
            with try_locked(cache, key) as free:
                if free:
                    _remove(cache / sub / name)
                    removed.append(cache / sub / name)
    return removed


# ------------------------------------------------------------------------------ locks
def _lock_path(cache: pathlib.Path, key: str) -> pathlib.Path:
    return cache / "locks" / f"{key}.lock"


def _open_lock(cache: pathlib.Path, key: str, create: bool = True) -> int:
    """A descriptor of `key`'s lock file. The file is never followed through a symbolic link nor
    taken when it is not a plain file of its own (a link planted in a shared cache would make
    O_CREAT create, and the holder's note overwrite, a file elsewhere)."""
    path = _lock_path(cache, key)
    if path.parent.is_symlink():
        raise CacheError(f"refusing the lock directory {path.parent}: it is a symbolic link "
                         f"(planted?); remove it")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags, 0o666)
        except PermissionError:  # another user's lock in a shared cache: flock needs no write
            fd = os.open(path, os.O_RDONLY | flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheError(f"refusing the lock file {path}: it is a symbolic link (planted?); "
                             f"remove it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise CacheError(f"refusing the lock file {path}: not a plain file of its own "
                         f"(a {'hard link' if stat.S_ISREG(st.st_mode) else 'special file'}); "
                         f"remove it")
    return fd


def _flock(fd: int, op: int) -> bool:
    """flock without blocking; False when another process holds a conflicting lock."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False


def _note_holder(fd: int, what: str) -> None:
    """Say in the lock file who holds it, for processes that wait (only in a file of our own)."""
    if os.fstat(fd).st_uid != os.getuid():
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)


def holder(cache: pathlib.Path, key: str) -> str:
    """Who holds `key`'s lock, as the holder noted it ("process 1234 building ...")."""
    try:
        pid, _, what = _lock_path(cache, key).read_text().strip().partition(" ")
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return "another process"
    return f"process {pid} ({what})" if what else f"process {pid}"


@contextlib.contextmanager
def locked(cache: pathlib.Path, key: str, what: str = "",
           waiting: Callable[[str], None] | None = None, every: float = 10.0):
    """Hold `key`'s lock exclusively. While another process holds it, `waiting` hears whom we
    wait for, after a second and then every `every` seconds."""
    fd = _open_lock(cache, key)
    try:
        t0 = time.monotonic()
        next_note = t0 + min(every, 1.0)  # a lock held for an instant is not worth a line
        while not _flock(fd, fcntl.LOCK_EX):
            if waiting and time.monotonic() >= next_note:
                waiting(f"waiting for {holder(cache, key)} to finish with {_lock_path(cache, key)} "
                        f"({time.monotonic() - t0:.0f}s so far)")
                next_note += every
            time.sleep(0.05)
        _note_holder(fd, what or f"building {key}")
        yield fd
    finally:
        os.close(fd)  # releases the lock


class Pins:
    """Shared locks on the entries a build uses, held until it has linked them: `clean --all`
    (which takes each key's lock exclusively, without waiting) leaves them alone."""

    def __init__(self, cache: pathlib.Path):
        self.cache = cache
        self._fds: set[int] = set()

    def try_pin(self, key: str) -> int | None:
        """Hold a shared lock on `key` and return its handle; None while a build holds it."""
        fd = _open_lock(self.cache, key)
        if not _flock(fd, fcntl.LOCK_SH):
            os.close(fd)
            return None
        self._fds.add(fd)
        return fd

    def keep(self, lock: int) -> None:
        """Turn the exclusive lock `locked` yielded into a pin (a duplicate descriptor shares
        the lock and outlives the `with`). Linux downgrades a flock under one spinlock, so no
        cleaner can take the key in between (an upgrade could drop it; we never upgrade)."""
        fcntl.flock(lock, fcntl.LOCK_SH)
        self._fds.add(os.dup(lock))

    def release(self, fd: int) -> None:
        self._fds.discard(fd)
        os.close(fd)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def try_locked(cache: pathlib.Path, key: str):
    """Yields True holding `key`'s lock, False if a live process holds it (shared or not)."""
    try:
        fd = _open_lock(cache, key, create=False)
    except FileNotFoundError:  # no lock was ever taken for key: nobody is building it
        yield True
        return
    try:
        yield _flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ survey
@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str                 # "library", "object", "runtime" or "staging"
    key: str
    path: pathlib.Path
    size: int                 # bytes on disk
    problem: str | None       # None: verified
    manifest: dict | None = None
    outdated: bool = False    # problem is only that an older flashgen wrote it (never used)


def _tree_size(path: pathlib.Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def survey(cache: pathlib.Path) -> list[Entry]:
    """Every entry of the cache, each verified against its records."""
    entries = []
    libs = cache / "libs"
    for d in sorted(libs.iterdir()) if libs.is_dir() else []:
        if d.name.startswith(STAGING_PREFIX):
            entries.append(Entry("staging", _staging_key(d.name), d, _tree_size(d), None))
            continue
        try:
            manifest, problem, outdated = verify_library(d), None, False
        except CorruptEntry as e:
            manifest, problem, outdated = None, str(e), isinstance(e, OutdatedEntry)
        entries.append(Entry("library", d.name, d, _tree_size(d), problem, manifest, outdated))
    for kind, (sub, suffix) in FILE_KINDS.items():
        entries += _survey_files(cache / sub, kind, suffix)
    return entries


def _survey_files(directory: pathlib.Path, kind: str, suffix: str) -> list[Entry]:
    entries = []
    paths = sorted(directory.iterdir()) if directory.is_dir() else []
    stems = {p.stem for p in paths if p.suffix == suffix}
    for p in paths:
        if p.name.startswith(STAGING_PREFIX) or p.name.endswith(".tmp"):
            entries.append(Entry("staging", _staging_key(p.name), p, _tree_size(p), None))
        elif p.suffix == suffix:
            size = sum(f.stat().st_size for f in _entry_files(p) if f.is_file())
            if not p.with_suffix(".json").exists():
                entries.append(Entry(kind, p.stem, p, size,
                                     "no record (written by an older flashgen)", outdated=True))
                continue
            try:
                _check_entry(p)
                problem = None
            except (OSError, ValueError, CorruptEntry) as e:
                problem = f"does not match its record ({e})"
            entries.append(Entry(kind, p.stem, p, size, problem))
        elif p.is_dir():  # an older flashgen's runtime/<key>/libflashgen_emu.so, unrecorded
            entries.append(Entry(kind, p.name, p, _tree_size(p), "no record (written by an older "
                                 "flashgen)", outdated=True))
        elif p.stem not in stems and p.suffix in (".json", ".ptx"):
            entries.append(Entry(kind, p.stem, p, _tree_size(p), f"{p.suffix} without its {suffix}"))
    return entries


def clean(cache: pathlib.Path, everything: bool = False) -> list[Entry]:
    """Remove stale staging and entries that fail verification (every entry with
    `everything`), skipping keys a live build holds. Returns what was removed."""
    if not writable(cache):
        raise CacheError(f"cannot clean the cache {cache}: it is read-only")
    removed = []
    for entry in survey(cache):
        if not (everything or entry.problem or entry.kind == "staging"):
            continue
        if entry.key is None:  # an older flashgen's staging: gone once it is an hour old
            if time.time() - entry.path.stat().st_mtime > 3600:
                _remove(entry.path)
                removed.append(entry)
            continue
        with try_locked(cache, entry.key) as free:
            if not free:
                continue
            if entry.kind == "library":
                discard(entry.path)
            elif entry.kind in FILE_KINDS and entry.path.is_file():
                for f in _entry_files(entry.path):
                    _remove(f)
            else:
                _remove(entry.path)
            removed.append(entry)
    return removed
