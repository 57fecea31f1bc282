"""gradaccum.atomic: a file is replaced whole or not at all, with a plain open's permissions."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gradaccum.atomic import fsync_dir, write_atomic, write_text_atomic


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

    with pytest.raises(OSError, match="No space left"):
        write_atomic(str(path), torn)
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
    from gradaccum.atomic import write_atomic

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
