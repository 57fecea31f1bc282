"""Two torchrun launchers on this machine, each a node of the same job, against one process.

The command is docs/distributed.md's multi-node one (`--nnodes 2 --nproc-per-node 2
--rdzv-backend c10d --rdzv-endpoint HOST:PORT`), with HOST this machine and PORT a free one.
The 4 ranks (2 per node, micro-batch 2) read, at each micro-step, the same 8 sequences one
process with micro-batch 8 reads (the data order is by global batch), so at the same tokens
per step the losses agree to fp32 rounding and the final weights within what AdamW makes of
that rounding (`adamw_drift_bound`), as in test_train_ddp.py.

No process of either launcher (launcher or rank) is left at the end (`launchers.finish`).
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import adamw_drift_bound, free_port
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics
from tests.distributed import launchers
from tests.distributed.launchers import finish

pytestmark = pytest.mark.slow

STEPS = 4
RUN_S = 150  # both launchers, 4 ranks, on a loaded 2-core machine


def records(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


def two_nodes(out, data, sync: str) -> list[subprocess.CompletedProcess]:
    """The job run by two launchers (node ranks 0 and 1) meeting at a free port under --sync
    `sync`; node 0 hosts the rendezvous."""
    port = free_port()
    args = ["-m", "gradaccum", "train", "--data", str(data), "--out", str(out)]
    args += ["--seq-len", "32", "--micro-batch", "2", "--accum-steps", "2"]
    args += ["--max-steps", str(STEPS), "--save-every", "2", "--eval-every", "0", "--json"]
    args += ["--sync", sync]
    started = {}
    for node in (0, 1):
        launcher = ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)]
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        launcher += ["--rdzv-id", "multinode-test", "--rdzv-conf", f"is_host={int(node == 0)}"]
        mark = f"{out}-node{node}"
        started[mark] = launchers.torchrun(launcher, args, mark)
    return list(finish(started, RUN_S).values())


@pytest.mark.parametrize("sync", ["window", "hsdp"])
def test_two_launchers_train_as_one_process_over_the_same_global_windows(tmp_path, sync):
    """window: DDP over the 4 ranks; hsdp: FSDP2 over a 2 x 2 mesh, each node one replica
    sharded over its 2 ranks, a reduce-scatter within the node per micro-batch and one
    all-reduce across the nodes per window."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    nodes = two_nodes(tmp_path / "nodes", data, sync)
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    printed = [node.stdout for node in nodes if node.stdout.strip()]
    assert len(printed) == 1  # global rank 0 alone prints, on whichever node it is
    summary = json.loads(printed[0])
    assert summary["world_size"] == 4 and summary["accum_steps"] == 2 and summary["sync"] == sync
    assert summary["tokens_per_step"] == 2 * 32 * 2 * 4 == 512

    one = train(
        TrainConfig(
            data=str(data),
            seq_len=32,
            micro_batch=8,
            accum_steps=2,
            max_steps=STEPS,
            eval_every=0,
            save_every=0,
            out=str(tmp_path / "one"),
        )
    )
    assert one["tokens_per_step"] == 512 and summary["tokens"] == one["tokens"] == STEPS * 512
    four, single = records(tmp_path / "nodes"), records(tmp_path / "one")
    for r in four:  # rank 0's gradient traffic per window
        if sync == "hsdp":  # per unit: k reduce-scatters of its gradient within the node,
            # then one all-reduce of its half (the node's shard) across the nodes
            assert r["grad_collectives"] == (2 + 1) * r["grad_replica_collectives"] >= 3 * 2
            assert r["grad_bytes"] == (2 * 2 + 1) * r["grad_replica_bytes"] > 0
        else:
            assert r["grad_collectives"] >= 1 and "grad_replica_collectives" not in r
    assert [r["step"] for r in four] == [r["step"] for r in single] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    assert four[0]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-5)
    a = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    state = checkpoint.load(checkpoint.find_latest(str(tmp_path / "nodes"))).trainer_state
    betas = tuple(state["optimizer"]["param_groups"][0]["betas"])
    bound = adamw_drift_bound([r["lr"] for r in four], betas)
    for key in a:  # plus a few fp32 roundings of the weights themselves per step
        torch.testing.assert_close(a[key], b[key], rtol=2**-20, atol=bound)
