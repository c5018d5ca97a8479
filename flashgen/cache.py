"""The on-disk kernel cache: layout, integrity records, verification and repair.

Layout (root: $FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen, else ~/.cache/flashgen):

    objects/<key>.o        one compiled source
    objects/<key>.json     its record {"size", "sha256"}, written after the .o: an object
                           without a matching record is no entry
    libs/<key>/            one library: lib*.so, manifest.json, src/ (the rendered sources,
                           for reading). The manifest records the size and sha256 of the .so
                           and a digest of itself.
    locks/<key>.lock       flock per key: concurrent builds of one key compile it once, and a
                           held lock marks that key's staging files as live

Entries appear atomically (os.replace of a finished file or directory) and are verified before
use: a truncated, altered or half-deleted entry is reported and rebuilt, never loaded. Staging
(`.tmp-<key>-*` under libs/ and objects/) left by a killed build is removed by the next build or
`flashgen cache clean` once no process holds that key's lock. Files are created with the
process's umask (no forced private modes), so a cache or an exported library can be shared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import secrets
import shutil
import time

MANIFEST = "manifest.json"
STAGING_PREFIX = ".tmp-"
_SELF_DIGEST = "manifest_sha256"


class CorruptEntry(Exception):
    """A cache entry or shipped library does not match its records; the message says how."""


class OutdatedEntry(CorruptEntry):
    """An entry written by an older flashgen, without integrity records: never used, not damaged."""


def root() -> pathlib.Path:
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "flashgen"


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
    return manifest


# ------------------------------------------------------------------------------ objects
def object_path(cache: pathlib.Path, key: str) -> pathlib.Path:
    return cache / "objects" / f"{key}.o"


def lookup_object(cache: pathlib.Path, key: str) -> pathlib.Path | None:
    """The verified object of `key`, or None when absent or not matching its record."""
    obj = object_path(cache, key)
    try:
        record = json.loads(obj.with_suffix(".json").read_text())
        check_file(obj, record)
    except (OSError, ValueError, CorruptEntry):
        return None
    return obj


def store_object(cache: pathlib.Path, key: str, tmp: pathlib.Path) -> pathlib.Path:
    """Move a freshly compiled object into the cache with its record (caller holds the key's lock)."""
    obj = object_path(cache, key)
    record = file_record(tmp)
    if record["size"] == 0:
        raise CorruptEntry(f"the compiler wrote an empty object for {key}")
    record_tmp = temp_path(obj.parent, key, ".json")
    record_tmp.write_text(json.dumps(record) + "\n")
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
    for sub in ("libs", "objects"):
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
@contextlib.contextmanager
def locked(cache: pathlib.Path, key: str):
    locks = cache / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def try_locked(cache: pathlib.Path, key: str):
    """Yields True holding `key`'s lock, False if a live process holds it."""
    try:
        f = open(cache / "locks" / f"{key}.lock", "a")
    except FileNotFoundError:  # no lock was ever taken for key: nobody is building it
        yield True
        return
    except OSError:  # a read-only cache: leave everything as it is
        yield False
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------ survey
@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str                 # "library", "object" or "staging"
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
    objects = cache / "objects"
    for p in sorted(objects.iterdir()) if objects.is_dir() else []:
        if p.name.startswith(STAGING_PREFIX) or p.name.endswith(".tmp"):
            entries.append(Entry("staging", _staging_key(p.name), p, _tree_size(p), None))
        elif p.suffix == ".o":
            if not p.with_suffix(".json").exists():
                entries.append(Entry("object", p.stem, p, p.stat().st_size,
                                     "no record (written by an older flashgen)", outdated=True))
                continue
            ok = lookup_object(cache, p.stem) is not None
            entries.append(Entry("object", p.stem, p, p.stat().st_size,
                                 None if ok else "does not match its size/sha256 record"))
        elif p.suffix == ".json" and not p.with_suffix(".o").exists():
            entries.append(Entry("object", p.stem, p, p.stat().st_size, "record without object"))
    return entries


def clean(cache: pathlib.Path, everything: bool = False) -> list[Entry]:
    """Remove stale staging and entries that fail verification (every entry with
    `everything`), skipping keys a live build holds. Returns what was removed."""
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
            else:
                _remove(entry.path)
                if entry.kind == "object":
                    _remove(entry.path.with_suffix(".json"))
            removed.append(entry)
    return removed
