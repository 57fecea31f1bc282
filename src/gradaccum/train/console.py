"""What a person sees while a run trains, the clock its times come from, and how they stop
it.

Text goes through the logger "gradaccum.train" (`gradaccum.utils.reporting`: by default each
line on stdout, or on stderr under --json so that stdout carries only the summary object; a
program can route or silence it). The live bar (tqdm) goes to stderr when stderr is a terminal; otherwise (a log file,
CI) a plain line is printed about 10 s in, then every tenth of the run or every 30 s,
whichever comes first (`Progress`).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from gradaccum.utils import reporting

reporting.configure()  # the package logger's own handler, once, before a program changes it
LOG = logging.getLogger("gradaccum.train")


class Console:
    """Says for rank 0 only, through `LOG`; `quiet` (--json) marks the lines for stderr."""

    def __init__(self, enabled: bool = True, quiet: bool = False):
        self.enabled = enabled
        self.extra = {reporting.TO_STDERR: quiet}

    def say(self, text: str = "") -> None:
        if self.enabled:
            LOG.info(text, extra=self.extra)


FIRST_LINE_S = 10.0
"""Seconds into training of the first log line (a tenth of the run, if sooner)."""
LINE_EVERY_S = 30.0
"""Seconds between two log lines at most; a tenth of the run, if sooner."""
BAR_SMOOTHING = 0.1
"""Weight of the newest step in the bar's moving averages: about the last 10 steps."""


class Progress:
    """step, loss, tokens/s, lr, k, time and ETA: a tqdm bar on a terminal, lines elsewhere.

    Lines (a log file, CI): the first FIRST_LINE_S seconds into training, then every tenth of
    the run or every LINE_EVERY_S seconds, whichever comes first, and at the last step. Their
    tokens/s is that of the steps since the previous line (their tokens over their seconds),
    not one step's. The bar's is an exponential moving average of tokens and seconds per
    step, weight BAR_SMOOTHING (about the last 10 steps)."""

    def __init__(self, console: Console, total_steps: int, start_step: int, accum_steps: int):
        self.console = console
        self.total = total_steps
        self.accum_steps = accum_steps
        self.bar = None
        self.window = ""  # what the last step held, where it varies
        self._last_line_s: float | None = None  # elapsed seconds at the last line; None: none
        self._tokens = self._seconds = 0.0  # since the last line
        self._ema: tuple[float, float] | None = None  # (tokens, seconds) per step
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

    @property
    def every(self) -> int:
        """Steps between two lines at most: a tenth of the run."""
        return max(1, self.total // 10)

    def update(
        self,
        step: int,
        loss: float,
        tokens: int,
        seconds: float,
        lr: float,
        elapsed_s: float,
        steps_done_here: int,
        window: str = "",
    ) -> None:
        """After optimizer step `step`, which trained on `tokens` in `seconds`; `elapsed_s`
        since training started in this process, `steps_done_here` steps of it. `window`:
        what the step held, where it varies ("32 ex, 187 tok" for --task sft)."""
        if not self.console.enabled:
            return
        self.window = f"  {window}" if window else ""
        if self.bar is not None:
            self._bar(step, loss, tokens, seconds, lr)
            return
        self._tokens += tokens
        self._seconds += seconds
        wait = FIRST_LINE_S if self._last_line_s is None else LINE_EVERY_S
        since = elapsed_s - (self._last_line_s or 0.0)
        if step % self.every and step != self.total and since < wait:
            return
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        eta = elapsed_s / max(steps_done_here, 1) * (self.total - step)
        self.console.say(
            f"step {step}/{self.total}  loss {loss:.4f}  {rate:,.0f} tok/s  lr {lr:.2e}  "
            f"k {self.accum_steps}{self.window}  {elapsed_s:.0f} s, eta {eta:.0f} s"
        )
        self._last_line_s, self._tokens, self._seconds = elapsed_s, 0.0, 0.0

    def _bar(self, step: int, loss: float, tokens: int, seconds: float, lr: float) -> None:
        a = BAR_SMOOTHING
        old = self._ema or (tokens, seconds)
        self._ema = (a * tokens + (1 - a) * old[0], a * seconds + (1 - a) * old[1])
        rate = self._ema[0] / self._ema[1] if self._ema[1] > 0 else 0.0
        self.bar.set_postfix_str(
            f"loss {loss:.4f}  {rate:,.0f} tok/s  lr {lr:.2e}  k {self.accum_steps}{self.window}",
            refresh=False,
        )
        self.bar.update(step - self.bar.n)

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


class Clock:
    """The run's times: this process's (`wall_s`), its loop's here (the ETA) and over every
    resume (`elapsed_s`, which the checkpoint keeps)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.here = self.loop_start = self.started
        self.first_step = 0

    def start_loop(self, elapsed_before: float, step: int) -> None:
        """The loop begins at optimizer step `step`, `elapsed_before` seconds into the run."""
        self.here = time.perf_counter()
        self.loop_start = self.here - elapsed_before
        self.first_step = step

    def elapsed(self) -> float:
        """Seconds since the run's loop first started, over every resume."""
        return time.perf_counter() - self.loop_start


class StopSignals:
    """SIGTERM and Ctrl-C ask the run to stop: it saves at the next window boundary and ends.

    `requested` names the signal ("SIGTERM" or "SIGINT") once one arrived. A second Ctrl-C
    raises KeyboardInterrupt at once, for someone who does not want to wait for the save; the
    Ctrl-Cs after it are ignored until the handlers are restored, so that the cleanup on the
    way out (a half-written checkpoint removed, the lock released) is not cut short in turn.
    Handlers are installed only in the main thread and restored on exit.
    """

    def __init__(self):
        self.requested: str | None = None
        self.interrupted = False
        """Whether a second Ctrl-C raised KeyboardInterrupt: a library whose C code it landed
        in may have turned it into an error of its own (matplotlib: ValueError)."""
        self._old: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.requested == "SIGINT":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.interrupted = True
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
