"""gradaccum.utils.atomic: a file is replaced whole or not at all, with a plain open's permissions."""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from gradaccum.utils.atomic import append_whole, fsync_dir, write_atomic, write_text_atomic
from gradaccum.utils.errors import DiskFull


def leftovers(folder) -> list[str]:
    return [e for e in os.listdir(folder) if e.startswith(".tmp-")]


def test_writes_and_replaces_the_whole_file(tmp_path):
    path = tmp_path / "a.txt"
    write_text_atomic(str(path), "first\n")
    assert path.read_text() == "first\n"
    write_atomic(str(path), lambda f: f.write(b"second"))
    assert path.read_bytes() == b"second"
    write_text_atomic(str(path), "ünïcode\n")
    assert path.read_bytes() == "ünïcode\n".encode()
    assert leftovers(tmp_path) == []


def test_a_failing_writer_leaves_the_previous_file_and_nothing_aside(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"previous")

    def torn(f):
        f.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(DiskFull) as raised:
        write_atomic(str(path), torn)
    assert str(raised.value) == f"{path}: not written (No space left on device)"
    assert path.read_bytes() == b"previous"
    assert leftovers(tmp_path) == []


def test_a_new_file_that_fails_is_not_created(tmp_path):
    with pytest.raises(RuntimeError):
        write_atomic(str(tmp_path / "new"), lambda f: (_ for _ in ()).throw(RuntimeError("x")))
    assert os.listdir(tmp_path) == []


def test_permissions_are_those_of_a_plain_open(tmp_path):
    mask = os.umask(0o027)
    try:
        write_text_atomic(str(tmp_path / "a"), "x")
        with open(tmp_path / "b", "w") as f:
            f.write("x")
    finally:
        os.umask(mask)
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("a") == mode("b") == 0o640


def test_fsync_dir_accepts_a_folder(tmp_path):
    fsync_dir(str(tmp_path))  # no error: the folder opened read-only and synced


KILLED = textwrap.dedent(
    """
    import sys, time
    from gradaccum.utils.atomic import write_atomic

    def slow(f):
        f.write(b"new " * 1000)
        f.flush()
        print("mid-write", flush=True)
        time.sleep(60)

    write_atomic(sys.argv[1], slow)
    """
)


@pytest.mark.slow
def test_a_process_killed_mid_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("previous")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "mid-write"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert path.read_text() == "previous"
    assert len(leftovers(tmp_path)) == 1  # the aside file a kill leaves; the next write is clean
    write_text_atomic(str(path), "next")
    assert path.read_text() == "next"


class NoRoomAfter:
    """A file whose write raises `error` (by default a full disk's) once `room` bytes went
    in: the lowest layer a writer (torch.save, savefig, json) reaches."""

    def __init__(self, f, room: int, error: BaseException | None = None):
        self.f, self.room = f, room
        self.error = error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, data) -> int:
        if len(data) > self.room:
            raise self.error
        self.room -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_torch_save_meeting_a_full_disk_is_disk_full_naming_the_file(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"previous")
    big = {"w": torch.ones(100_000)}
    # torch reports it as RuntimeError "[enforce fail at inline_container.cc] unexpected pos"
    with open(os.devnull, "wb") as sink, pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save(big, NoRoomAfter(sink, 1000))
    with pytest.raises(DiskFull) as raised:
        write_atomic(str(path), lambda f: torch.save(big, NoRoomAfter(f, 1000)))
    assert str(raised.value) == f"{path}: not written (No space left on device)"
    assert path.read_bytes() == b"previous" and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "code, words", [(errno.EDQUOT, "Disk quota exceeded"), (errno.EFBIG, "File too large")]
)
def test_a_quota_or_a_file_size_limit_is_no_room_too(tmp_path, code, words):
    def write(f):
        NoRoomAfter(f, 0, OSError(code, os.strerror(code))).write(b"x")

    with pytest.raises(DiskFull, match=f"not written \\({words}\\)"):
        write_atomic(str(tmp_path / "a"), write)
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_that_torch_reported_as_its_own_error_is_a_ctrl_c_again(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"previous")

    def write(f):
        torch.save({"w": torch.ones(1000)}, NoRoomAfter(f, 500, KeyboardInterrupt()))

    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(path), write)
    assert path.read_bytes() == b"previous" and leftovers(tmp_path) == []


def test_an_append_is_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    append_whole(fd, b'{"step": 1}\n', str(path))
    real, calls = os.write, []

    def half_then_full(fd_, data):  # what a nearly full disk does: part of it, then no room
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd_, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(DiskFull, match="metrics.jsonl: not written"):
        append_whole(fd, b'{"step": 2, "loss": 1.5}\n', str(path))
    monkeypatch.undo()
    assert len(calls) == 2 and path.read_bytes() == b'{"step": 1}\n'  # the half line is gone
    append_whole(fd, b'{"step": 2}\n', str(path))
    os.close(fd)
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
