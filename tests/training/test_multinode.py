"""A multi-node launch drilled on one machine: two torchrun agents (`--nnodes 2`, node ranks 0
and 1, rendezvous at 127.0.0.1) each start one `mea-pretrain` worker; together they train a
TP=2 KHA model across the two "nodes" and checkpoint it, exactly like a single-node TP=2 run."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests._dist import free_port, run_distributed
from tests._models import tiny_flags

# torchrun's multi-agent launch: application code, the same on every Megatron-Core release;
# tested with one. It waits on wall-clock time: `make test` runs it in its serial pass.
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16"), pytest.mark.serial]

ARGS = tiny_flags(mock_data=True, eval_interval=None, eval_iters=0, log_interval=1, train_iters=4,
                  lr=3e-3, min_lr=3e-4, attention_variant="kha", tensor_model_parallel_size=2,
                  sequence_parallel=True)
# Variables of an enclosing launcher that would change what torchrun sets up.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


def _train(rank, world_size, argv):
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain

    return [record["lm loss"] for record in pretrain(*parse_run(argv))]


def test_two_torchrun_agents_train_and_checkpoint_like_one_node(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = [*ARGS, "--data-cache-path", str(tmp_path / "cache"), "--save", save,
            "--save-interval", "2"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", port, "-m", "megatron_mea.cli.pretrain", *argv],
            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"node {node}:\n{outputs[node][-4000:]}"

    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as handle:
        assert handle.read() == "4"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [
        "iter_0000002", "iter_0000004"]
    # Both "nodes" wrote their tensor-parallel shards of the checkpoint.
    shards = [n for n in os.listdir(os.path.join(save, "iter_0000004")) if n.endswith(".distcp")]
    assert {name.split("_")[2] for name in shards} == {"0", "1"}, shards  # __<rank>_<n>.distcp
    with open(os.path.join(save, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    losses = [r["lm loss"] for r in records]
    assert all(math.isfinite(loss) for loss in losses)

    # The same run on one "node" (two processes of one launcher) gives the same losses.
    single = run_distributed(_train, 2, [*ARGS, "--data-cache-path", str(tmp_path / "cache")])[0]
    assert max(abs(a - b) for a, b in zip(losses, single)) < 1e-6, (losses, single)
