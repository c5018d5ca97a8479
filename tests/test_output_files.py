"""Output files: `-o`, `--report`, `--outputs`, `--json` never destroy what they point at.

Special files are written in place, symlinks are followed to their target, the input is never
overwritten, and every location is checked before anything is written (issue 15, item 2).
"""
from __future__ import annotations

import os
import pathlib
import stat
import threading

import pytest

from flashgen import cli, output_files
from flashgen.errors import FlashgenError, UsageError

GOLDEN = pathlib.Path(__file__).parent / "golden" / "inputs"
CAUSAL = GOLDEN / "jnn_causal_bf16.mlir"


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr()


def _char_device(tmp_path):
    """A private copy of /dev/null (same major/minor): a regression cannot damage the real one."""
    path = tmp_path / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a device node here: {e}")
    return path


def _leftovers(directory):
    return sorted(p.name for p in pathlib.Path(directory).iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------ the CLI
def test_char_device_written_in_place(tmp_path, capsys):
    dev = _char_device(tmp_path)
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", dev)
    assert rc == 0, io_.err
    assert stat.S_ISCHR(os.lstat(dev).st_mode), "the device node was replaced"
    assert not _leftovers(tmp_path)


def test_fifo_written_in_place(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", fifo)
    reader.join(30)
    assert rc == 0, io_.err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    assert got and b"flashgen_fwd" in got[0]


def test_symlink_is_followed_and_kept(tmp_path, capsys):
    target = tmp_path / "real" / "out.mlir"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.mlir"
    link.symlink_to(target)
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", link)
    assert rc == 0, io_.err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "flashgen_fwd" in target.read_text()
    assert not _leftovers(tmp_path) and not _leftovers(target.parent)


def test_dangling_symlink_creates_its_target(tmp_path, capsys):
    link = tmp_path / "link.mlir"
    link.symlink_to(tmp_path / "new.mlir")
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", link)
    assert rc == 0, io_.err
    assert link.is_symlink() and "flashgen_fwd" in (tmp_path / "new.mlir").read_text()


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "report"])
def test_output_equal_to_input_is_refused(tmp_path, capsys, how):
    src = tmp_path / "in.mlir"
    src.write_bytes(CAUSAL.read_bytes())
    before = src.read_bytes()
    out = src
    if how == "symlink":
        out = tmp_path / "alias.mlir"
        out.symlink_to(src)
    elif how == "hard link":
        out = tmp_path / "alias.mlir"
        os.link(src, out)
    flag = "--report" if how == "report" else "-o"
    rc, io_ = run_cli(capsys, "rewrite", src, flag, out)
    assert rc == 2
    assert "is the input" in io_.err and "Traceback" not in io_.err
    assert src.read_bytes() == before


def test_report_into_missing_directory_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.mlir"
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", out, "--report", tmp_path / "no" / "r.json")
    assert rc == 2 and "--report" in io_.err and "does not exist" in io_.err
    assert not out.exists()


def test_two_outputs_at_one_file_refused(tmp_path, capsys):
    out = tmp_path / "out.mlir"
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", out, "--report", out)
    assert rc == 2 and "same file" in io_.err
    assert not out.exists()


def test_directory_and_unwritable_refused(tmp_path, capsys):
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", tmp_path)
    assert rc == 2 and "is a directory" in io_.err
    locked = tmp_path / "ro.mlir"
    locked.write_text("keep")
    locked.chmod(0o444)
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", locked)
    assert rc == 2 and "read-only" in io_.err
    assert locked.read_text() == "keep"


def test_modes_follow_umask_and_existing_file(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", tmp_path / "new.mlir")
    finally:
        os.umask(old)
    assert rc == 0, io_.err
    assert stat.S_IMODE(os.stat(tmp_path / "new.mlir").st_mode) == 0o640
    kept = tmp_path / "kept.mlir"
    kept.write_text("old")
    kept.chmod(0o604)
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", kept)
    assert rc == 0, io_.err
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o604 and "flashgen_fwd" in kept.read_text()


def test_run_outputs_checked_before_running(tmp_path, capsys):
    rc, io_ = run_cli(capsys, "run", CAUSAL, "--outputs", tmp_path / "missing" / "o.npz")
    assert rc == 2 and "--outputs" in io_.err and "does not exist" in io_.err
    dev = _char_device(tmp_path)
    rc, io_ = run_cli(capsys, "run", CAUSAL, "--outputs", dev)
    assert rc == 0, io_.err
    assert stat.S_ISCHR(os.lstat(dev).st_mode)
    rc, io_ = run_cli(capsys, "run", CAUSAL, "--outputs", CAUSAL)
    assert rc == 2 and "is the input" in io_.err


def test_run_outputs_name_is_kept(tmp_path, capsys):
    """np.savez appends '.npz' to a name without it; the file the user named is written."""
    import numpy as np
    out = tmp_path / "result"
    rc, io_ = run_cli(capsys, "run", CAUSAL, "--outputs", out)
    assert rc == 0, io_.err
    assert out.is_file() and not (tmp_path / "result.npz").exists()
    assert list(np.load(out).files) == ["out0"]


# ------------------------------------------------------------------------------ the module
def test_failed_write_leaves_old_content_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    (out,) = output_files.check([("-o", str(target))])

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(FlashgenError, match="-o .*out.bin: cannot write: disk full; its old"):
        out.write(b"new")
    assert target.read_bytes() == b"old" and not _leftovers(tmp_path)


def test_check_messages(tmp_path):
    with pytest.raises(UsageError, match="--json: .* is a directory"):
        output_files.check([("--json", str(tmp_path))])
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    import socket
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock_dir / "sock"))
        with pytest.raises(UsageError, match="socket"):
            output_files.check([("-o", str(sock_dir / "sock"))])
    finally:
        s.close()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(UsageError, match="symbolic links"):
        output_files.check([("-o", str(loop))])
    made = output_files.check([("--json", str(tmp_path / "a" / "b" / "r.json"))], make_dirs=True)
    assert made[0].path.endswith("r.json")
    assert not (tmp_path / "a").exists(), "checking must not create anything"


def test_build_out_checked_before_compiling(tmp_path, capsys):
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    rc, io_ = run_cli(capsys, "build", "--hdim", "32", "--dtype", "f32", "--target", "cpu",
                      "--out", not_dir)
    assert rc == 2 and "--out" in io_.err and "is not a directory" in io_.err
    assert "compil" not in io_.err


def test_build_out_follows_symlinks(tmp_path, capsys):
    out, real = tmp_path / "lib", tmp_path / "real.json"
    out.mkdir()
    (out / "manifest.json").symlink_to(real)
    rc, io_ = run_cli(capsys, "build", "--hdim", "32", "--dtype", "f32", "--target", "cpu",
                      "--out", out)
    assert rc == 0, io_.err
    assert (out / "manifest.json").is_symlink() and '"specs"' in real.read_text()


@pytest.mark.parametrize("flag", ["--report", "-o"])
def test_an_output_at_a_file_build_writes_is_refused(tmp_path, capsys, flag):
    """--build DIR writes DIR/manifest.json: a report or module written there made the library
    unloadable, rc 0."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text("keep")
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "--build", tmp_path, flag, manifest)
    assert rc == 2 and f"{flag} and --build name the same file" in io_.err, io_.err
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", manifest, "--build")  # DIR: OUT's directory
    assert rc == 2 and "-o and --build name the same file" in io_.err, io_.err
    library = tmp_path / "_flashgen_cpu_0123456789abcdef.so"
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "--build", tmp_path, flag, library)
    assert rc == 2 and f"--build and {flag} name the same file" in io_.err, io_.err
    assert manifest.read_text() == "keep" and not library.exists()


def test_a_full_disk_names_the_file(capsys):
    """/dev/full: a real ENOSPC on write. The message was only '[Errno 28] No space left on
    device', naming no file."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    rc, io_ = run_cli(capsys, "rewrite", CAUSAL, "-o", "/dev/full")
    assert rc == 1
    assert io_.err.strip() == "flashgen: error: -o /dev/full: cannot write: No space left on device"
