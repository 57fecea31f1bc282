"""`train --tensorboard` (or tensorboard in --report-to, `trackers`): every metrics.jsonl
field as a TensorBoard scalar, under `<out>/tensorboard/`. An optional extra (`pip install gradaccum[tensorboard]`): without the
package the flag is refused with the name of the extra to install.

The event file is written here, in the training thread, one record at a time with the
tensorboard package's own record format and protos, not through torch's SummaryWriter: that
writes from a background thread, where a full disk is a traceback on stderr and an error
raised later at an unrelated call. Here a full disk is a DiskFull at the write that met it,
and the file keeps only whole records (`gradaccum.utils.atomic.append_whole`).
"""

from __future__ import annotations

import io
import math
import os
import socket
import time

from gradaccum.utils.atomic import append_whole, writing
from gradaccum.utils.errors import BadInput

_NOT_SCALARS = ("step", "skipped")


def scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers by the names every tracker shows them under: training
    fields as `train/loss`, the held-out loss as `eval/eval_loss`, an event's (out of memory
    mid-window) under `event/`. The step and the skipped flag are not scalars; a nan or an
    infinity is left out rather than drawn as a spike."""
    prefix = "eval" if "eval_loss" in record else "event" if "event" in record else "train"
    return {
        f"{prefix}/{key}": float(value)
        for key, value in record.items()
        if key not in _NOT_SCALARS
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def check_available() -> None:
    """BadInput naming the extra when the tensorboard package is not installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise BadInput(
            "--tensorboard",
            None,
            "needs the tensorboard package: pip install 'gradaccum[tensorboard]'",
        ) from None


def _open_new(folder: str) -> tuple[int, str]:
    """A new event file in `folder`, named as TensorBoard's writers name theirs."""
    stem = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    for uid in range(1000):
        path = os.path.join(folder, f"{stem}.{uid}")
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free event file name for {stem}")


class TensorBoardWriter:
    """Writes each metrics record's numbers as scalars at its optimizer step: training
    fields under `train/`, the held-out loss under `eval/`, events (out of memory mid-window)
    under `event/`. No room on the disk: DiskFull naming the event file."""

    def __init__(self, out: str, purge_step: int | None = None):
        check_available()
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        folder = os.path.join(out, "tensorboard")
        with writing(folder):
            os.makedirs(folder, exist_ok=True)
            self._fd, self.path = _open_new(folder)
        events = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:
            # A resumed run drops events past its checkpoint, as metrics.jsonl does: the
            # reader discards what an earlier file holds from this step on.
            events.append(Event(step=purge_step, file_version="brain.Event:2"))
            start = SessionLog(status=SessionLog.START)
            events.append(Event(step=purge_step, wall_time=time.time(), session_log=start))
        try:
            self._append(events)
        except BaseException:
            self.close()
            raise

    def _append(self, events) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        buffer = io.BytesIO()
        records = RecordWriter(buffer)
        for event in events:
            records.write(event.SerializeToString())
        append_whole(self._fd, buffer.getvalue(), self.path)

    def write(self, record: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=t, simple_value=v) for t, v in scalars(record).items()]
        if values:
            summary = Summary(value=values)
            step = int(record["step"])
            self._append([Event(wall_time=time.time(), step=step, summary=summary)])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
