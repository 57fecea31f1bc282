"""What a person sees while a run trains, and how they stop it.

Text goes to stdout, or to stderr under --json so that stdout carries only the summary
object. The live bar (tqdm) goes to stderr when stderr is a terminal; otherwise (a log file,
CI) a plain line is printed every tenth of the run.
"""

from __future__ import annotations

import signal
import sys
import threading


class Console:
    """Prints for rank 0 only; `quiet` (--json) sends text to stderr instead of stdout."""

    def __init__(self, enabled: bool = True, quiet: bool = False):
        self.enabled = enabled
        self.stream = sys.stderr if quiet else sys.stdout

    def say(self, text: str = "") -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


class Progress:
    """step, loss, tokens/s, lr, k and ETA: a tqdm bar on a terminal, log lines elsewhere."""

    def __init__(self, console: Console, total_steps: int, start_step: int, accum_steps: int):
        self.console = console
        self.total = total_steps
        self.accum_steps = accum_steps
        self.every = max(1, total_steps // 10)
        self.bar = None
        if console.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )

    def update(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        lr: float,
        elapsed_s: float,
        steps_done_here: int,
    ) -> None:
        if not self.console.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  lr {lr:.2e}  k {self.accum_steps}",
                refresh=False,
            )
            self.bar.update(step - self.bar.n)
            return
        if step % self.every == 0 or step == self.total:
            left = self.total - step
            eta = elapsed_s / max(steps_done_here, 1) * left
            self.console.say(
                f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                f"lr {lr:.2e}  k {self.accum_steps}  eta {eta:.0f} s"
            )

    def note(self, text: str) -> None:
        """A line between bar updates (eval loss, checkpoint saved)."""
        if not self.console.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            self.console.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StopSignals:
    """SIGTERM and Ctrl-C ask the run to stop: it saves at the next window boundary and ends.

    `requested` names the signal ("SIGTERM" or "SIGINT") once one arrived. A second Ctrl-C
    raises KeyboardInterrupt at once, for someone who does not want to wait for the save.
    Handlers are installed only in the main thread and restored on exit.
    """

    def __init__(self):
        self.requested: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.requested == "SIGINT":
            raise KeyboardInterrupt
        self.requested = self.requested or name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False
