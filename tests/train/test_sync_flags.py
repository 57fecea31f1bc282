"""`gradaccum train --sync` refused where the run cannot shard its model: one line `--flag
value: why`, exit 2 through the command line, nothing written in --out. The ranks' meshes are
tested in tests/distributed (test_elastic.py, test_multinode.py)."""

import os

import pytest

from gradaccum.parallel import sharding
from gradaccum.parallel.process_group import RankInfo
from gradaccum.train import parts
from gradaccum.train.config import TrainConfig
from gradaccum.utils.errors import BadInput

from .helpers import one_line_error


def _refused(capsys, tmp_path, *argv) -> str:
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", "--out", str(out), "--max-steps", "1", *argv])
    assert not out.exists(), os.listdir(out)
    return line.removeprefix("gradaccum: error: ")


@pytest.mark.parametrize(
    "argv, start",
    [
        (["--sync", "micro"], "--sync micro: one process has no ranks to sync"),
        (["--sync", "hsdp"], "--sync hsdp: one process has no ranks to sync"),
        (["--sync", "micro", "--task", "grpo"], "--task grpo: with --sync micro: each rank"),
        (["--sync", "hsdp", "--compile"], "--compile: with --sync hsdp: not with a model"),
        (
            ["--sync", "micro", "--lora-rank", "4", "--base-bits", "4"],
            "--base-bits 4: with --sync micro: a base in 4 or 8 bits",
        ),
    ],
)
def test_refused_in_one_line(capsys, tmp_path, argv, start):
    assert _refused(capsys, tmp_path, *argv).startswith(start)


def test_window_is_ddp_and_takes_no_mesh():
    config = TrainConfig(sync="window")
    assert not config.shards_model and not TrainConfig().shards_model
    assert TrainConfig(sync="micro").shards_model and TrainConfig(sync="hsdp").shards_model
    parts.check_sync(config, RankInfo(0, 1, 0, None, None, False))  # nothing to refuse


@pytest.mark.parametrize(
    "world, local, shape",
    [(4, 2, (2, 2)), (8, 4, (2, 4)), (6, 2, (3, 2)), (4, 4, None), (4, 1, None), (6, 4, None)],
)
def test_hsdp_replicas_are_the_nodes(monkeypatch, world, local, shape):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    per_node = sharding.per_node(world)
    assert per_node == (local if world % local == 0 else world)
    assert sharding.hsdp_shape(world, per_node) == shape
    rank = RankInfo(0, world, 0, None, "gloo", False)
    if shape is None:
        with pytest.raises(BadInput, match="do not make a mesh of replicas x shards"):
            parts.check_sync(TrainConfig(sync="hsdp"), rank)
    else:
        parts.check_sync(TrainConfig(sync="hsdp"), rank)
    parts.check_sync(TrainConfig(sync="micro"), rank)  # any world of 2 or more
