"""The small run the resume tests stop, resume and compare with the same run left alone: its
TrainConfig, stopping it after a given step as Ctrl-C would, and its newest checkpoint."""

from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint


def small_config(out, data_file, **kw) -> TrainConfig:
    """A run into `out` on the token file `data_file`: 16-token sequences, 2 of them per
    micro-batch, 2 micro-batches per step, no eval, a checkpoint every 2 steps; `kw` adds to
    or overrides those fields (the tests give max_steps)."""
    base = dict(
        out=str(out),
        data=str(data_file),
        seq_len=16,
        micro_batch=2,
        accum_steps=2,
        eval_every=0,
        save_every=2,
    )
    return TrainConfig(**{**base, **kw})


def train_until(config: TrainConfig, step: int) -> dict:
    """Train `config`, stopped once `step` optimizer steps are done, as a signal stops it (a
    checkpoint there, then the run ends); the run's summary."""
    return train(config, should_stop=lambda done: done >= step)


def latest_checkpoint(out) -> checkpoint.Checkpoint:
    """The newest complete checkpoint of the run in `out`, loaded."""
    return checkpoint.load(checkpoint.find_latest(str(out)))
