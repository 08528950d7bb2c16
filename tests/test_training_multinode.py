"""Two real hosts on one machine: network namespaces joined by a veth pair, each with its own
address, each running `anchorctx train` as a cluster scheduler would (the same command on every
node, no ssh), with sequence parallelism across the two nodes over gloo.

- a killed node makes the other fail fast with a one-line error, `--resume` on both nodes
  finishes the run, and the finished run equals a one-process run (losses and final weights,
  the SP test's tolerance);
- a node that does not share run_root (a private tmpfs mounted over it) fails at start-up.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
import torch
from distributed import free_port, torch_extensions  # noqa: F401  (fixture)
from safetensors.torch import load_file

from anchorctx.io import read_jsonl

RTOL = 1e-5  # as tests/test_training_sp.py: fp32 reduction-order noise, with a 100x margin
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def hosts():
    """Two hosts: (namespace, address, interface) each, joined by a veth pair."""
    if reason := netns.unavailable():
        pytest.skip(reason)
    with netns.two_hosts() as nodes:
        yield nodes


def _start_node(
    hosts, rank: int, config: Path, log: Path, *extra: str, private_dir: Path | None = None
) -> subprocess.Popen:
    """`anchorctx train` inside node ``rank``'s namespace (optionally with ``private_dir``
    replaced by an empty tmpfs only this node sees: a run_root that is not shared)."""
    ns, _, dev = hosts[rank]
    cmd = [
        sys.executable,
        "-m",
        "anchorctx",
        "train",
        str(config),
        "--node-rank",
        str(rank),
        "--master-addr",
        hosts[0][1],
        *extra,
    ]
    if private_dir is not None:
        mount = f'mount -t tmpfs anchorctx-private {private_dir} && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": dev,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    with log.open("w") as out:  # the node writes to its own copy of the file descriptor
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                netns.kill_tree(q.pid)
            raise
    return codes


def _config(tiny_config, packed_demo, tmp_path: Path, name: str, steps: int, **training) -> Path:
    cfg = tiny_config.model_copy(
        update={
            "name": name,
            "run_root": tmp_path / "runs",
            "data": tiny_config.data.model_copy(update={"output_dir": packed_demo}),
            "training": tiny_config.training.model_copy(
                update={"steps": steps, "attention": "anchor", **training}
            ),
        }
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _two_node(tiny_config, packed_demo, tmp_path, name, steps, **training) -> Path:
    return _config(
        tiny_config,
        packed_demo,
        tmp_path,
        name,
        steps,
        nnodes=2,
        nproc=1,
        sequence_parallel=2,
        master_port=free_port(),
        **training,
    )


def test_a_killed_node_fails_the_other_and_the_run_resumes(
    hosts,
    tiny_config,
    packed_demo,
    tmp_path,
    torch_extensions,  # noqa: F811 (fixture)
):
    """Two nodes train, one dies, the other fails fast with one line, both resume, and the
    finished run equals a one-process run: losses and final weights (the SP test's tolerance).
    The steps before the kill ran in the fresh two-node job, the others in the resumed one: the
    comparison covers a two-node run from its start and a resumed one (no separate uninterrupted
    run, which would cost ~20 s of CPU in six processes more)."""
    from anchorctx.cli import main

    # The kill comes right after step 3 (the resume state of step 2 is written by then; the
    # metrics are polled every 0.05 s). A node waits for the other at every step, so node 0
    # stops within a step or two of the kill, short of 8, and the resumed run still trains on
    # both nodes: from step 3 (or 5) to 8.
    steps = 8
    save = tiny_config.training.save.model_copy(update={"every": 1000, "resume_every": 2})
    config = _two_node(tiny_config, packed_demo, tmp_path, "kill", steps=steps, save=save)
    one = _config(tiny_config, packed_demo, tmp_path, "one", steps=steps, save=save)
    run_dir = tmp_path / "runs" / "kill" / "anchor"
    logs = [tmp_path / f"node{r}.log" for r in range(2)]
    procs = [_start_node(hosts, r, config, logs[r]) for r in range(2)]
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(read_jsonl(metrics)) >= 3):
        assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
        assert procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.05)  # a step takes ~0.15 s (read_jsonl skips a line torn mid-write)
    netns.kill_tree(procs[1].pid)  # node 1 dies: its launcher, torchrun and worker at once
    killed_at = time.monotonic()
    code = _finish([procs[0]], timeout=120)[0]
    assert code != 0
    assert time.monotonic() - killed_at < 120
    out = logs[0].read_text()
    assert "anchorctx train: node 0 of 2: the distributed job failed" in out, out[-3000:]
    done = len(read_jsonl(metrics))
    assert done < steps, "the run finished before the node was killed: nothing was tested"

    logs = [tmp_path / f"resume{r}.log" for r in range(2)]
    procs = [_start_node(hosts, r, config, logs[r], "--resume") for r in range(2)]
    try:  # the one-process reference meanwhile, while the nodes start (~10 s of imports each)
        assert main(["train", str(one)]) == 0
    finally:
        codes = _finish(procs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # rank 0 alone wrote them
    manifest = (run_dir / "manifest.json").read_text()
    assert '"sp": 2' in manifest and '"world": 2' in manifest
    run_one = tmp_path / "runs" / "one" / "anchor"
    loss_one = [r["loss"] for r in read_jsonl(run_one / "metrics.jsonl")]
    assert [r["loss"] for r in records] == pytest.approx(loss_one, rel=RTOL)
    last = f"step-{steps:06d}"
    a = load_file(run_one / "checkpoints" / last / "model.safetensors")
    b = load_file(run_dir / "checkpoints" / last / "model.safetensors")
    for name, ref in a.items():
        rel = torch.linalg.vector_norm(b[name] - ref) / torch.linalg.vector_norm(ref)
        assert rel <= RTOL, f"{name}: {rel:.2e}"


def test_a_node_without_the_shared_run_root_fails_at_start(
    hosts,
    tiny_config,
    packed_demo,
    tmp_path,
    torch_extensions,  # noqa: F811 (fixture)
):
    config = _two_node(tiny_config, packed_demo, tmp_path, "private", steps=2)
    (tmp_path / "runs").mkdir(exist_ok=True)
    logs = [tmp_path / f"node{r}.log" for r in range(2)]
    procs = [
        _start_node(hosts, 0, config, logs[0]),
        _start_node(hosts, 1, config, logs[1], private_dir=tmp_path / "runs"),
    ]
    codes = _finish(procs, timeout=240)
    assert all(c != 0 for c in codes)
    for log in logs:
        assert "run_root is not shared: rank 1" in log.read_text(), log.read_text()[-3000:]
