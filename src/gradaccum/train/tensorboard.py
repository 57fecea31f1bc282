"""`train --tensorboard`: every metrics.jsonl field as a TensorBoard scalar, under
`<out>/tensorboard/`. An optional extra (`pip install gradaccum[tensorboard]`): without the
package the flag is refused with the name of the extra to install.
"""

from __future__ import annotations

import math
import os

from ..errors import BadInput

_NOT_SCALARS = ("step", "skipped")


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


class TensorBoardWriter:
    """Writes each metrics record's numbers as scalars at its optimizer step: training
    fields under `train/`, the held-out loss under `eval/`, events (out of memory mid-window)
    under `event/`."""

    def __init__(self, out: str, purge_step: int | None = None):
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops events past its checkpoint, as metrics.jsonl does.
        self._writer = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        prefix = "eval" if "eval_loss" in record else "event" if "event" in record else "train"
        for key, value in record.items():
            if (
                key in _NOT_SCALARS
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(f"{prefix}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
