"""`python -m gradaccum` for torchrun, with one fault for the elastic test: on torchrun's first
start of the group (TORCHELASTIC_RESTART_COUNT 0), the rank named by GRADACCUM_TEST_KILL_RANK
SIGKILLs itself as its micro-batch number GRADACCUM_TEST_KILL_AT_MICRO (counted from 1 over
the run) starts its forward: mid-window, when the window's earlier micro-batches are done and
its gradient sync not. Without those variables it is `python -m gradaccum`.

A test hook, kept out of the package: it wraps the loss the trainer's loop calls.
"""

from __future__ import annotations

import os
import signal
import sys


def arm() -> None:
    """Wrap the loop's loss so that this rank kills itself at the micro-batch asked, if any."""
    rank, at = (
        os.environ.get("GRADACCUM_TEST_KILL_RANK"),
        os.environ.get("GRADACCUM_TEST_KILL_AT_MICRO"),
    )
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank is None or at is None or not first_start or os.environ.get("RANK") != rank:
        return
    from gradaccum.train.tasks import language

    loss, calls = language.causal_lm_loss, [0]

    def killing_loss(model, micro):
        calls[0] += 1
        if calls[0] == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        return loss(model, micro)

    language.causal_lm_loss = killing_loss


if __name__ == "__main__":
    arm()
    from gradaccum.cli import main

    sys.exit(main())
