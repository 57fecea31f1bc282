"""--task grpo: RL fine-tuning (the GRPO family) on prompts, each step --prompts-per-step
prompts x --num-generations sampled completions scored by --reward (`gradaccum.train.grpo`
samples, scores and evaluates; `gradaccum.rl.PolicyLoss` is the loss)."""

from __future__ import annotations

import os
from dataclasses import replace

from gradaccum import rl
from gradaccum.train import grpo, parts, sft
from gradaccum.train.checks import WARM_START
from gradaccum.train.console import Console
from gradaccum.train.tasks.protocol import Begin, TaskBase, TaskWindow
from gradaccum.train.tasks.rules import GRPORules
from gradaccum.utils.errors import BadInput

WARM_START_STEPS = 600
"""Steps of the SFT stage that --task grpo on the built-in set without --init-from starts
with (the built-in tasks' answers are then partly right: rewards to learn from)."""


class PolicyOptimization(TaskBase):
    rules = GRPORules
    evaluates_first = True  # the starting model's figures, to compare

    @classmethod
    def first_stage(cls, config, rank_info, run_stage):
        """No model given (no --model, --model-config or --init-from) on the built-in set: a
        short SFT run in --out/sft first (continued where it stopped, skipped once finished),
        then the GRPO run from it: (the GRPO config, None); or (config, the SFT run's summary)
        when a stop request ended the SFT stage."""
        from gradaccum.train.config import TrainConfig
        from gradaccum.train.rundir.checkpoint import step_folders

        if config.init_from or config.model_config or config.model or config.data:
            return config, None
        grpo.check_builtin_rewards(config)  # --reward refused before the SFT stage, not after
        folder = os.path.join(config.out, WARM_START)
        if not os.path.exists(os.path.join(folder, "model.pt")):
            stage = TrainConfig(task="sft", seq_len=config.seq_len,
                                seed=config.seed, max_steps=WARM_START_STEPS, out=folder,
                                resume=bool(step_folders(folder)), json=config.json,
                                device=config.device, precision=config.precision)  # fmt: skip
            if rank_info.rank == 0 and not config.json:
                Console().say(f"grpo: no --init-from: first {WARM_START_STEPS} steps of SFT "
                              f"on the built-in set in {folder}, then GRPO from that model")  # fmt: skip
            summary = run_stage(stage)
            if summary.get("stopped"):
                return config, summary
        resume = bool(step_folders(config.out))  # the GRPO stage's own checkpoints
        return replace(config, init_from=os.path.abspath(folder), model=None, resume=resume), None

    def load_data(self) -> sft.SFTParts:
        data = sft.load_data(self.config)  # the examples' prompts
        self.tokenizer_dir = data.tokenizer_dir
        return data

    def batch_request(self, data, model, say):
        self.prompts = grpo.prompts_of(data.train, data.tokenizer, self.config.seq_len)
        return grpo.batch_request(self.config, self.rank_info.world_size, len(self.prompts))

    def resume_batch_request(self, data, ckpt):
        return self.batch_request(data, None, None)

    def begin(self, run: Begin) -> None:
        """The prompts, the eval set's size, the rewards (checked before any generation) and
        the loss (`rl.PolicyLoss`)."""
        super().begin(run)
        config, data = self.config, run.data
        if not run.dense:
            raise BadInput("--model", config.preset, "a mixture of experts: not with --task grpo")
        self.model, self.data = run.model, data  # self.prompts: from `batch_request`
        self.eval_sizes = grpo.eval_sizes(config, run.total_steps, len(data.val))
        self.eval_prompts = grpo.eval_prompts(data.val, data.tokenizer, config.seq_len,
                                              self.eval_sizes[1])  # fmt: skip
        grpo.check(config, self.prompts)
        self.rewards = grpo.rewards_of(config, self.prompts)
        self.policy = rl.PolicyLoss(config.loss_type, config.epsilon, config.epsilon_high,
                                    config.beta, config.max_completion_length,
                                    config.temperature)  # fmt: skip
        self.count_tokens = rl.counter(config.loss_type, config.max_completion_length)

    def stream(self, data, micro: int) -> grpo.GRPOStream:
        """Sampled and scored completions; with --beta the starting model, frozen, as the
        reference."""
        config, device, reference = self.config, self.rank_info.device, None
        if config.beta:
            reference = parts.new_model(config, data.info, device)[0]
            reference.to(device).eval().requires_grad_(False)
        model = self.model
        return grpo.GRPOStream(config, self.prompts, data.tokenizer, self.rewards,
                               lambda: parts.unwrapped(model), micro, self.rank_info,
                               reference)  # fmt: skip

    def next_window(self, stream, k: int) -> TaskWindow:
        """The window's completions, their rewards and lengths as the record's fields."""
        window = next(stream)
        self.policy.start_tracking()
        return TaskWindow(window.micro_batches, window.examples, window.shares, window.fields)

    def loss(self, model, micro: dict, weight: float):
        return self.policy(model, micro, track=weight != 0)  # a stand-in not tracked

    def record(self, result, window: TaskWindow) -> tuple[dict, list[str]]:
        """The completions, their rewards, the loss's figures."""
        fields = {"completions": window.examples, "counted": result.tokens, **window.fields}
        fields.update(grpo.loss_fields(self.policy.totals, self.config.beta))
        reward = grpo.reward_words(fields, self.rewards)
        return fields, [f"reward {reward}, length {fields['completion_length']:.1f}"]

    def evaluate(self, model, data, micro: int) -> tuple[dict, list[str]]:
        """The held-out loss and exact match, and the reward of held-out samples."""
        device, precision = self.rank_info.device, self.config.precision
        fields, lines = sft.evaluate(model, data, micro, device, precision, self.eval_sizes[0])
        sampled, words = grpo.evaluate_rewards(model, self.eval_prompts, data.tokenizer,
                                               self.rewards, self.config)  # fmt: skip
        lines[0] += words
        return {**fields, **sampled}, lines

    def eval_fingerprint(self, data) -> str:
        return sft.fingerprint([], data.val)

    def opening(self, data, batch, resolved) -> tuple[str | None, list[str]]:
        """Prompts, completions, the loss, the rewards; the data's lines; the evaluation."""
        table = "\n".join(grpo.plan_lines(self.config, self.rewards, self.rank_info.world_size))
        lines = data.summary_lines() + [grpo.eval_line(self.config, self.eval_sizes, batch.total)]
        return table, lines

    def length_line(self, data, batch, resolved) -> str:
        return grpo.length_line(self.config, len(self.prompts), batch.total)

    def plot_title(self, records: list[dict], model_info, batch) -> str:
        config = self.config
        return (
            f"{model_info.source}, --task grpo, {grpo.prompts_per_step(config)} prompts x "
            f"{config.num_generations} completions/step, --loss-type {config.loss_type}"
        )
