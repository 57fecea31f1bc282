"""--task pretrain: a causal LM on a token stream, --tokens-per-step per optimizer step.

Its data are sequences of --seq-len tokens (`parts.load_data`), its stream `Batches` (one
micro-batch per `next`, k of them a window), its loss the summed next-token cross-entropy
(`causal_lm_loss`), its evaluation the held-out loss. --micro-batch auto is measured here
(`micro_batch.measure`) and --epochs counted in tokens."""

from __future__ import annotations

from gradaccum.data.batches import Batches
from gradaccum.train import micro_batch, parts
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.epochs import pretrain_epoch_tokens, pretrain_length_line
from gradaccum.train.evaluation import EVAL_TOKENS, evaluate
from gradaccum.train.tasks import language
from gradaccum.train.tasks.protocol import TaskBase, TaskData
from gradaccum.train.tasks.rules import PretrainRules
from gradaccum.utils.sizes import fmt_count


class Pretraining(TaskBase):
    rules = PretrainRules

    def load_data(self) -> TaskData:
        data = parts.load_data(self.config)
        return TaskData(data.train, data.val, data.info, data.eod_id)

    def batch_request(self, data: TaskData, model, say) -> BatchRequest:
        """--micro-batch auto measured where the batch leaves it to choose."""
        if micro_batch.measures(self.config, self.rank_info.world_size):
            return micro_batch.measure(self.config, model, data, self.rank_info, say)
        return BatchRequest.of(self.config)

    def epoch_tokens(self, data: TaskData) -> int | None:
        """--epochs in tokens (`epochs.pretrain_epoch_tokens`); None without it."""
        return pretrain_epoch_tokens(self.config.epochs, len(data.train), self.config.seq_len)

    def stream(self, data: TaskData, micro: int) -> Batches:
        rank, world = self.rank_info.rank, self.rank_info.world_size
        # with --document-mask, eod_id masks each micro-batch
        return Batches(data.train, micro, self.config.seed, rank, world, eod_id=data.eod_id)

    def loss(self, model, micro: dict, weight: float):
        return language.micro_batch_loss(model, micro)

    def evaluate(self, model, data: TaskData, micro: int) -> tuple[dict, list[str]]:
        config = self.config
        loss = evaluate(model, data.val, micro, self.rank_info.device, config.precision,
                        data.eod_id)  # fmt: skip
        return {"eval_loss": loss}, [f"eval loss {loss:.4f}"]

    def eval_fingerprint(self, data: TaskData) -> str:
        """The held-out sequences an evaluation reads (the first EVAL_TOKENS tokens)."""
        from gradaccum.data.tokens import fingerprint

        val = data.val
        sequences = min(len(val), max(1, EVAL_TOKENS // val.seq_len))
        return fingerprint(val.tokens[: sequences * val.seq_len + 1])

    def opening(self, data: TaskData, batch, resolved) -> tuple[str | None, list[str]]:
        return None, parts.document_mask_lines(data)

    def length_line(self, data: TaskData, batch, resolved) -> str:
        if batch.varies:
            return (f"length {fmt_count(batch.total_tokens)} tokens (--max-tokens), the steps "
                    "as k grows")  # fmt: skip
        return pretrain_length_line(self.config, len(data.train), resolved.total_steps,
                                    batch.tokens_per_step)  # fmt: skip

    def plot_title(self, records: list[dict], model_info, batch) -> str:
        """The model and the batch: b x k x world, or a schedule's first and last batch."""
        if not batch.varies:
            return (
                f"{model_info.source}, {batch.tokens_per_step:,} tokens/step "
                f"(b {batch.micro_batch} x k {batch.k} x world {batch.world_size})"
            )
        sizes = [r["tokens_per_step"] for r in records if "tokens_per_step" in r] or [0]
        return (
            f"{model_info.source}, {fmt_count(sizes[0])} -> {fmt_count(sizes[-1])} "
            f"tokens/step (--batch-schedule {self.config.batch_schedule})"
        )

    def summary_fields(self, records: list[dict], batch, steps: int) -> dict:
        return {"tokens_per_step": batch.tokens_per_step}
