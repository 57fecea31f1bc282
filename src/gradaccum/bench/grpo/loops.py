"""The two contestants of `gradaccum bench --task grpo`, each one optimizer step per window
over the same k micro-batches of the same completions:

- ours: `Accumulator(count_tokens=rl.counter(loss_type, max_completion_length))` with
  `rl.PolicyLoss` as its loss_fn, fp32: each micro-batch's summed loss over the window's one
  count (completions, completion tokens, or completions x max_completion_length);
- TRL: a `GRPOTrainer` (its GRPOConfig with per_device_train_batch_size = micro_batch,
  gradient_accumulation_steps = steps_per_generation = k, num_generations, loss_type, beta 0,
  max_completion_length, temperature, fp32, no gradient checkpointing, nothing reported or
  saved) driven through the Trainer's own per-micro-batch path: `training_step(model, inputs,
  None)` for each micro-batch (the Trainer's `compute_loss`, its division by k unless the
  trainer says its loss is scaled for accumulation, and the backward), then the optimizer
  and scheduler step and zero_grad, as `Trainer.train`'s inner loop does once per window with
  `current_gradient_accumulation_steps` = k. Only the generation is not TRL's: its
  `_prepare_inputs` (which would sample) hands back the micro-batch it is given, the dict its
  `_generate_and_score_completions` returns for these completions (`window.trl_micro_batches`).

Read from trl 1.16's `_compute_loss`: grpo is each micro-batch's mean of its completions'
token means, bnpo its tokens' sum over its own token count, dr_grpo its sum over its rows x
max_completion_length, each then / k; dapo is the sum over num_items_in_batch (the generation
batch's tokens) x k / steps_per_generation, the window's count. GRPOTrainer sets
loss_is_scaled_for_ga, so the Trainer divides by k no more.
"""

from __future__ import annotations

import torch

from gradaccum import rl
from gradaccum.bench.grpo.window import ours_micro_batches, trl_micro_batches
from gradaccum.engine.accumulator import Accumulator


def ours_step(model, optimizer, cfg, loss_type: str, workdir: str):
    """`step(micro_batches)`: one window through the Accumulator, one optimizer step."""
    acc = Accumulator(
        model, optimizer, count_tokens=rl.counter(loss_type, cfg.max_completion_length)
    )
    loss_fn = rl.PolicyLoss(
        loss_type, max_completion_length=cfg.max_completion_length, temperature=cfg.temperature
    )
    return lambda micro_batches: acc.step(micro_batches, loss_fn)


def trl_step(model, optimizer, cfg, loss_type: str, workdir: str):
    """`step(micro_batches)`: one window through TRL's per-micro-batch path and one optimizer
    step, as the Trainer's inner loop runs it (module docstring)."""
    trainer = trl_trainer(model, optimizer, cfg, loss_type, workdir)

    def step(micro_batches) -> None:
        trainer.current_gradient_accumulation_steps = len(micro_batches)
        for inputs in micro_batches:
            trainer.training_step(trainer.model, inputs, None)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.model.zero_grad(set_to_none=True)

    return step


def trl_trainer(model, optimizer, cfg, loss_type: str, workdir: str):
    """A GRPOTrainer around `model` and `optimizer`, set up as the module docstring says."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gradaccum.bench.sft.loops import hf_byte_tokenizer

    args = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.accum_steps,
        steps_per_generation=cfg.accum_steps,
        num_generations=cfg.num_generations,
        loss_type=loss_type,
        beta=0.0,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        bf16=False,
        gradient_checkpointing=False,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=next(model.parameters()).device.type == "cpu",
        dataloader_pin_memory=False,
        seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_no_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * cfg.completions_per_step}),
        processing_class=hf_byte_tokenizer(),
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    trainer._prepare_inputs = lambda inputs: inputs  # the completions are sampled already
    return trainer


def _no_reward(prompts, completions, **kwargs) -> list[float]:
    """The trainer needs a reward function; the window's rewards are given with it."""
    return [0.0] * len(prompts)


CONTESTANTS = (
    ("gradaccum", ours_step, ours_micro_batches),
    ("trl", trl_step, trl_micro_batches),
)
"""(name, make step(micro_batches) from (model, optimizer, cfg, loss_type, workdir), the
window's micro-batches as it takes them from (window, micro_batch, device)), ours first."""
