"""--task sft: supervised fine-tuning on (prompt, completion) examples, counted in examples or
in target tokens per step (`gradaccum.train.sft` holds the data, the windows and the
evaluation; this is what the loop asks of them)."""

from __future__ import annotations

from gradaccum.train import micro_batch, sft, sft_plan
from gradaccum.train.config import AUTO
from gradaccum.train.tasks import language
from gradaccum.train.tasks.protocol import Begin, TaskBase, TaskWindow
from gradaccum.train.tasks.rules import SFTRules


class FineTuning(TaskBase):
    rules = SFTRules
    dense = True
    plan = None
    """What its steps hold (`sft_plan.SFTPlan`), measured when the run starts."""

    def load_data(self) -> sft.SFTParts:
        data = sft.load_data(self.config)
        self.tokenizer_dir = data.tokenizer_dir
        return data

    def batch_request(self, data: sft.SFTParts, model, say):
        """The window's examples as sequences of --seq-len (`sft.batch_request`), at the
        micro-batch --micro-batch auto measured."""
        config, measured = self.config, None
        if config.micro_batch == AUTO:
            per_step = sft.examples_per_step(config, data.train)
            measured = micro_batch.measure_sft(config, model, data.info.vocab_size, per_step,
                                               self.rank_info, say)  # fmt: skip
        return sft.batch_request(config, data.train, self.rank_info.world_size, measured)

    def resume_batch_request(self, data: sft.SFTParts, ckpt):
        """The windows are counted in examples, whatever the layout
        (`sft.resume_batch_request`)."""
        return sft.resume_batch_request(self.config, ckpt, data.train, self.rank_info.world_size)

    def begin(self, run: Begin) -> None:
        super().begin(run)
        self.dense = run.dense  # no empty rows for a mixture of experts' balance to route

    def stream(self, data: sft.SFTParts, micro: int) -> sft.SFTStream:
        rank, world = self.rank_info.rank, self.rank_info.world_size
        pad = data.tokenizer.pad_id
        return sft.SFTStream(self.config, data.train, pad, micro, rank, world, self.dense)

    def next_window(self, stream, k: int) -> TaskWindow:
        """This rank's share of the window's examples, per micro-batch."""
        window = next(stream)
        return TaskWindow(window.micro_batches, window.examples, window.shares)

    def loss(self, model, micro: dict, weight: float):
        return language.micro_batch_loss(model, micro)

    def record(self, result, window: TaskWindow) -> tuple[dict, list[str]]:
        """What the window held: examples, and the tokens N counts."""
        fields = {"examples": window.examples, "counted_tokens": result.tokens}
        return fields, [f"{window.examples} ex, {result.tokens} tok"]

    def evaluate(self, model, data: sft.SFTParts, micro: int) -> tuple[dict, list[str]]:
        """The held-out loss over target tokens; on the built-in set exact match too."""
        return sft.evaluate(model, data, micro, self.rank_info.device, self.config.precision)

    def eval_fingerprint(self, data: sft.SFTParts) -> str:
        return sft.fingerprint([], data.val)

    def opening(self, data: sft.SFTParts, batch, resolved) -> tuple[str | None, list[str]]:
        """The plan's table in examples and counted tokens (`sft_plan`), the data's lines
        and how --packing cuts a window."""
        config, world = self.config, self.rank_info.world_size
        self.plan = sft_plan.measure(config, data.train, batch.micro_batch, world, batch.total,
                                     resolved.warmup_steps, fill_rows=self.dense)  # fmt: skip
        table = sft_plan.render(sft_plan.rows(self.plan, config, resolved.plan))
        return table, data.summary_lines() + sft.plan_lines(config, data, batch.micro_batch)

    def length_line(self, data: sft.SFTParts, batch, resolved) -> str:
        return sft.length_line(self.config, data.train)

    def plot_title(self, records: list[dict], model_info, batch) -> str:
        """The examples and the mean counted tokens per step."""
        config = self.config
        counted = [r["counted_tokens"] for r in records if "counted_tokens" in r] or [0]
        per_step = config.target_examples_per_step
        size = f"{per_step} examples" if per_step else f"<= {config.tokens_per_step:,} tokens"
        return (
            f"{model_info.source}, --task sft, {size}/step "
            f"({sum(counted) / len(counted):,.0f} counted tokens/step)"
        )

    def summary_fields(self, records: list[dict], batch, steps: int) -> dict:
        plan = self.plan.to_dict() if self.plan is not None else None
        return {**super().summary_fields(records, batch, steps), "plan": plan}
