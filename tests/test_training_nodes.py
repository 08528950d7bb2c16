"""Node rank and rendezvous address from flags, Slurm or torchrun's variables (no GPU, no
network): the rules of :mod:`anchorctx.training.nodes`."""

from __future__ import annotations

import pytest

from anchorctx.training.nodes import DEFAULT_PORT, first_host, rendezvous_args, resolve_nodes
from anchorctx.training.plan import TrainingError


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node7", "node7"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[3,5],cpu1", "gpu3"),
        ("a-b-01,a-b-02", "a-b-01"),
        ("rack1-n[001-128]", "rack1-n001"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_flags_win_over_the_environment():
    env = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    spec = resolve_nodes(2, node_rank=0, master_addr="h0", environ=env)
    assert (spec.node_rank, spec.master_addr, spec.master_port, spec.source) == (
        0,
        "h0",
        1234,
        "flags",
    )


def test_slurm_environment():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[10-13]"}
    spec = resolve_nodes(4, environ=env)
    assert (spec.node_rank, spec.master_addr, spec.master_port, spec.source) == (
        3,
        "gpu10",
        DEFAULT_PORT,
        "slurm",
    )
    with pytest.raises(TrainingError, match=r"training.nnodes=2 but Slurm allocated 4 .*nnodes=4"):
        resolve_nodes(2, environ=env)


def test_torchrun_variables():
    env = {
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "head",
        "PET_MASTER_PORT": "29600",
        "NODE_RANK": "0",
        "MASTER_ADDR": "other",
    }
    spec = resolve_nodes(2, environ=env)
    assert (spec.node_rank, spec.master_addr, spec.master_port) == (1, "head", 29600)
    assert rendezvous_args(spec, 8) == [
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--master-addr=head",
        "--master-port=29600",
    ]


def test_missing_or_bad_node_information_is_one_clear_error():
    with pytest.raises(TrainingError, match="--node-rank and --master-addr"):
        resolve_nodes(2, environ={})
    with pytest.raises(TrainingError, match="--master-addr"):
        resolve_nodes(2, node_rank=1, environ={})
    with pytest.raises(TrainingError, match=r"node rank 2 is outside 0\.\.1"):
        resolve_nodes(2, node_rank=2, master_addr="h", environ={})
    with pytest.raises(TrainingError, match="NODE_RANK='x' is not an integer"):
        resolve_nodes(2, environ={"NODE_RANK": "x", "MASTER_ADDR": "h"})
