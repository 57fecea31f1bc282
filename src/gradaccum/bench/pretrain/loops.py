"""The contestants: how each loop a user would pick runs one window per optimizer step.

Each contestant turns (model, optimizer) into `run(windows, tick)`: it trains on the windows
in order, one optimizer step per window, and calls `tick()` after each step. All of them see
the same micro-batches; the loss is the cross-entropy over each batch's valid labels
(`causal_lm_loss`), and what differs is how each scales it before backward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradaccum.engine.accumulator import Accumulator
from gradaccum.models.loss import causal_lm_loss

Run = Callable[[list[list[dict]], Callable[[], None]], None]


@dataclass
class Setup:
    """What every contestant is given besides its model and optimizer."""

    device: torch.device
    accum_steps: int
    """Micro-batches per optimizer step (k)."""
    workdir: str
    """A scratch folder for peers that insist on an output folder (removed afterwards)."""
    seed: int


@dataclass
class Contestant:
    name: str
    """The name in the JSON and in --peers."""
    label: str
    """The name in the table."""
    make: Callable[[torch.nn.Module, torch.optim.Optimizer, Setup], Run]
    divides_by_k: bool = False
    """Whether, as used here, it divides each micro-batch's mean loss by k."""
    needs: tuple[str, ...] = ()
    """Packages it imports; missing ones skip it."""

    def missing(self) -> str | None:
        """Why it cannot run here, or None."""
        for package in self.needs:
            try:
                importlib.import_module(package)
            except ImportError:
                return f"{package} not installed (pip install 'gradaccum[bench]')"
        return None


def gradaccum_run(model, optimizer, setup: Setup) -> Run:
    acc = Accumulator(model, optimizer)

    def run(windows, tick):
        for window in windows:
            acc.step(window, causal_lm_loss)
            tick()

    return run


def hand_run(model, optimizer, setup: Setup) -> Run:
    """The shortest loop people write: each micro-batch's mean loss divided by k."""

    def run(windows, tick):
        for window in windows:
            for batch in window:
                loss_sum, n = causal_lm_loss(model, batch)
                (loss_sum / n / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tick()

    return run


def accelerate_run(model, optimizer, setup: Setup) -> Run:
    """`accelerator.accumulate` as its documentation shows it: the mean loss per micro-batch,
    `accelerator.backward` divides it by k, the wrapped optimizer steps every k-th call.

    Accelerate keeps its accumulation settings in process-wide state that the Transformers
    Trainer also writes, so each run builds its Accelerator afresh, as a user's script does."""
    from accelerate import Accelerator

    def run(windows, tick):
        accelerator = Accelerator(
            gradient_accumulation_steps=setup.accum_steps,
            cpu=setup.device.type == "cpu",
            device_placement=False,
        )
        net, opt = accelerator.prepare(model, optimizer)
        for window in windows:
            for batch in window:
                with accelerator.accumulate(net):
                    loss_sum, n = causal_lm_loss(net, batch)
                    accelerator.backward(loss_sum / n)
                    opt.step()
                    opt.zero_grad()
            tick()

    return run


class CausalLM(torch.nn.Module):
    """The model as a Hugging Face causal LM looks to a trainer: `forward(input_ids, labels,
    **kwargs)` returns {"loss"}, the mean over valid labels, or the sum divided by
    `num_items_in_batch` when the trainer passes it (as Hugging Face models do)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        loss_sum, n = causal_lm_loss(self.model, {"input_ids": input_ids, "labels": labels})
        return {"loss": loss_sum / (n if num_items_in_batch is None else num_items_in_batch)}


def _micro_batches(windows) -> list[dict]:
    return [batch for window in windows for batch in window]


def trainer_run(model, optimizer, setup: Setup) -> Run:
    """The Transformers Trainer with `gradient_accumulation_steps=k`, one micro-batch per
    loader item, our optimizer, no clipping, nothing logged or saved."""
    from torch.utils.data import IterableDataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if setup.device.type not in ("cpu", "cuda") or (setup.device.index or 0) != 0:
        raise RuntimeError(f"runs here on cpu or cuda:0 only, not {setup.device}")

    class MicroBatches(IterableDataset):
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            return iter(self.batches)

    class Tick(TrainerCallback):
        def __init__(self, tick):
            self.tick = tick

        def on_step_end(self, args, state, control, **kwargs):
            self.tick()

    wrapped = CausalLM(model)

    def run(windows, tick):
        args = TrainingArguments(
            output_dir=setup.workdir,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=setup.accum_steps,
            max_steps=len(windows),
            max_grad_norm=0.0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=setup.device.type == "cpu",
            dataloader_pin_memory=False,
            remove_unused_columns=False,
            seed=setup.seed,
        )
        trainer = Trainer(
            model=wrapped,
            args=args,
            train_dataset=MicroBatches(_micro_batches(windows)),
            data_collator=lambda items: items[0],
            optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
            callbacks=[Tick(tick)],
        )
        trainer.train()

    return run


def lightning_run(model, optimizer, setup: Setup) -> Run:
    """Lightning's `accumulate_grad_batches=k`: `training_step` returns the micro-batch's
    mean loss, Lightning divides it by k and steps every k-th batch."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    kind = setup.device.type
    if kind not in ("cpu", "cuda", "mps"):
        raise RuntimeError(f"Lightning has no accelerator for {kind}")
    accelerator = {"cpu": "cpu", "cuda": "gpu", "mps": "mps"}[kind]
    devices = [setup.device.index or 0] if kind == "cuda" else 1
    k = setup.accum_steps

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss_sum, n = causal_lm_loss(self.model, batch)
            return loss_sum / n

        def configure_optimizers(self):
            return optimizer

    class Tick(pl.Callback):
        def __init__(self, tick):
            self.tick = tick

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % k == 0:
                self.tick()

    def run(windows, tick):
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=devices,
            precision="32-true",
            max_steps=len(windows),
            max_epochs=1,
            accumulate_grad_batches=k,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=setup.workdir,
            callbacks=[Tick(tick)],
        )
        loader = DataLoader(_micro_batches(windows), batch_size=None, shuffle=False)
        trainer.fit(Module(), loader)

    return run


CONTESTANTS = (
    Contestant("gradaccum", "gradaccum Accumulator", gradaccum_run),
    Contestant("hand-loop", "hand loop (mean / k)", hand_run, divides_by_k=True),
    Contestant("accelerate", "Accelerate accumulate", accelerate_run, True, needs=("accelerate",)),
    Contestant(
        "trainer",
        "Transformers Trainer",
        trainer_run,
        needs=("transformers", "accelerate"),
    ),
    Contestant(
        "lightning", "Lightning accumulate_grad_batches", lightning_run, True, ("lightning",)
    ),
)
"""In the order of the table: gradaccum, the hand loop, then the peers."""
