"""What a task supplies to `gradaccum train`, and nothing else (docs/tasks.md).

The loop (`gradaccum.train.loop.Run`) owns the windows, the engine, recovery, outputs and
checkpoints; a task owns what differs between pretraining, fine-tuning and RL: its rules
(`rules.TaskRules`: defaults and the settings it refuses), its data, its window stream, the
summed loss of one micro-batch and its count (the engine divides once, by the window's count
over every micro-batch and rank), its evaluation, the fields it adds to a window's metrics
record, its opening lines and plot title, and its own state.

One `Task` is made per run, `TaskClass(config, rank_info)`, before anything else. Then:
`load_data` -> `batch_request` (or `resume_batch_request`) -> `begin` once the batch is
planned -> `stream` -> per window `next_window`, `loss` per micro-batch, `record` -> `evaluate`
between windows -> `state_dict` with each checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.tasks.rules import TaskRules


@dataclass
class TaskData:
    """A task's data as the loop reads it: what to train on, what to evaluate on (`len` 0:
    no evaluation), and what it is (`DataInfo`: source, vocabulary, fingerprint)."""

    train: Any
    val: Any
    info: Any
    eod_id: int | None = None
    """Pretraining's --document-mask id; None otherwise."""


@dataclass
class TaskWindow:
    """One window as a task hands it to the loop."""

    micro_batches: list[dict]
    """This rank's micro-batches (each a dict of tensors: input_ids, labels, ...)."""
    examples: int = 0
    """Examples (GRPO: completions) in the window over all ranks; 0 where not counted."""
    shares: bool = True
    """False when this rank holds no example of the window (it then only joins the
    collectives, with a stand-in of weight 0)."""
    fields: dict = field(default_factory=dict)
    """Metrics fields of the window's own (GRPO: rewards, lengths)."""


@runtime_checkable
class Stream(Protocol):
    """A task's training stream, as the loop, its out-of-memory recovery and its checkpoint
    read it (the built-in tasks' `Batches`, `SFTStream` and `GRPOStream`)."""

    position: Any
    """An opaque place in the data order, read before a window and set to rewind to it."""

    def set_micro_batch(self, micro_batch: int) -> None: ...
    def __next__(self) -> Any: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, other_data: bool = False) -> None: ...


@dataclass
class Begin:
    """What a task learns once the run is built (`Task.begin`)."""

    model: Any
    """The placed model (under DDP or FSDP2); `gradaccum.train.parts.unwrapped` gives the
    module."""
    model_info: Any
    total_steps: int
    """The run's optimizer steps."""
    dense: bool
    """False for a mixture of experts (whose balance counts every row's tokens)."""
    data: Any = None
    """The run's data (`Task.load_data`'s)."""


class Task(Protocol):
    """The protocol (`TaskBase` gives every member but the four a task must write:
    `load_data`, `stream`, `loss`, `evaluate`)."""

    rules: ClassVar[type[TaskRules]]
    count_tokens: Any
    """The engine's token count of a micro-batch ("auto": labels other than -100)."""
    evaluates_first: bool
    """Whether the starting model is evaluated before the first window."""
    tokenizer_dir: str | None
    """The folder of the tokenizer to export beside the model; None: none."""

    def load_data(self) -> TaskData: ...
    def batch_request(self, data: TaskData, model, say) -> BatchRequest: ...
    def resume_batch_request(self, data: TaskData, ckpt) -> BatchRequest | None: ...
    def epoch_tokens(self, data: TaskData) -> int | None: ...
    def begin(self, run: Begin) -> None: ...
    def stream(self, data: TaskData, micro_batch: int) -> Stream: ...
    def next_window(self, stream: Stream, k: int) -> TaskWindow: ...
    def loss(self, model, micro: dict, weight: float) -> tuple[Any, Any]: ...
    def record(self, result, window: TaskWindow) -> tuple[dict, list[str]]: ...
    def evaluate(self, model, data: TaskData, micro_batch: int) -> tuple[dict, list[str]]: ...
    def eval_fingerprint(self, data: TaskData) -> str: ...
    def opening(self, data: TaskData, batch, resolved) -> tuple[str | None, list[str]]: ...
    def length_line(self, data: TaskData, batch, resolved) -> str: ...
    def plot_title(self, records: list[dict], model_info, batch) -> str: ...
    def summary_fields(self, records: list[dict], batch, steps: int) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class TaskBase:
    """The members of `Task` a task may leave as they are: the settings' own plan, no epochs,
    k micro-batches of the stream per window, nothing added to the records or the summary,
    no state. A task of one's own inherits it and writes `load_data`, `stream`, `loss` and
    `evaluate`."""

    rules: ClassVar[type[TaskRules]] = TaskRules
    count_tokens: Any = "auto"
    evaluates_first = False
    tokenizer_dir: str | None = None

    def __init__(self, config, rank_info):
        self.config, self.rank_info = config, rank_info

    def batch_request(self, data: TaskData, model, say) -> BatchRequest:
        """The batch the run's plan is made for (`resolve_run`): the settings' own."""
        return BatchRequest.of(self.config)

    def resume_batch_request(self, data: TaskData, ckpt) -> BatchRequest | None:
        """A resumed run's; None: the micro-batch and k it trained with, for this number of
        devices (the run plans it with `resume.batch_request`)."""
        return None

    def epoch_tokens(self, data: TaskData) -> int | None:
        return None

    def begin(self, run: Begin) -> None:
        self.total_steps = run.total_steps

    def next_window(self, stream: Stream, k: int) -> TaskWindow:
        return TaskWindow([next(stream) for _ in range(k)])

    def record(self, result, window: TaskWindow) -> tuple[dict, list[str]]:
        return {}, []

    def eval_fingerprint(self, data: TaskData) -> str:
        """What --save-best's best was measured on (a resume on other eval data looks anew)."""
        return str(getattr(data.info, "fingerprint", ""))

    def opening(self, data: TaskData, batch, resolved) -> tuple[str | None, list[str]]:
        """The plan's table in place of the batch's (None: the batch's), and lines after the
        run's own opening lines."""
        return None, []

    def length_line(self, data: TaskData, batch, resolved) -> str:
        return f"length {batch.total} steps (--max-steps)"

    def plot_title(self, records: list[dict], model_info, batch) -> str:
        return (
            f"{model_info.source}, --task {self.config.task}, b {batch.micro_batch} x k "
            f"{batch.k} x world {batch.world_size}"
        )

    def summary_fields(self, records: list[dict], batch, steps: int) -> dict:
        """The --json fields of the task's own; tokens_per_step: the mean counted tokens of a
        step (a window's count varies)."""
        return {"tokens_per_step": batch.tokens // max(steps, 1)}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")
