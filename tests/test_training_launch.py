"""``anchorctx train`` with ``training.sequence_parallel=2`` on CPU launches two gloo processes
(torchrun child) and trains exactly like one process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest
import torch
from distributed import torch_extensions  # noqa: F401  (fixture)
from safetensors.torch import load_file

from anchorctx.cli import main
from anchorctx.io import read_jsonl
from anchorctx.process import run_process_group


@pytest.mark.distributed
def test_cli_sp2_launch_matches_one_process(tiny_config, packed_demo, tmp_path, torch_extensions):  # noqa: F811
    config = tmp_path / "config.yaml"
    config.write_text(tiny_config.to_yaml())
    common = [
        "--set",
        "training.steps=2",
        "--set",
        f"data.output_dir={packed_demo}",
        "--set",
        f"run_root={tmp_path}",
    ]
    assert main(["train", str(config), *common, "--set", "name=one"]) == 0
    assert (
        main(
            [
                "train",
                str(config),
                *common,
                "--set",
                "name=two",
                "--set",
                "training.sequence_parallel=2",
            ]
        )
        == 0
    )
    one, two = (tmp_path / n / "anchor" for n in ("one", "two"))
    manifest = (two / "manifest.json").read_text()
    assert '"sp": 2' in manifest and '"world": 2' in manifest
    layout = json.loads(manifest)["layout"]  # what the run trains with, DeepSpeed's settings too
    assert (layout["sp"], layout["dp"], layout["zero_stage"]) == (2, 1, 0)
    assert layout["deepspeed_comm"] == {} and "plan" not in layout  # CPU: nothing planned
    a = load_file(one / "checkpoints" / "step-000002" / "model.safetensors")
    b = load_file(two / "checkpoints" / "step-000002" / "model.safetensors")
    for name, ref in a.items():
        rel = torch.linalg.vector_norm(b[name] - ref) / torch.linalg.vector_norm(ref)
        assert rel <= 1e-6, f"{name}: {rel:.2e}"
    loss_a = [r["loss"] for r in read_jsonl(one / "metrics.jsonl")]
    loss_b = [r["loss"] for r in read_jsonl(two / "metrics.jsonl")]
    assert loss_a == pytest.approx(loss_b, rel=1e-6)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_interrupt_kills_the_whole_process_group(tmp_path):
    """A cancelled launch (any BaseException while waiting) leaves no worker behind."""
    pids = tmp_path / "pids"
    child = (
        "import os, subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}')\n"
        "time.sleep(120)\n"
    )

    def interrupt_when_started() -> None:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)

    def raise_interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, raise_interrupt)
    try:
        threading.Thread(target=interrupt_when_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_process_group([sys.executable, "-c", child])
    finally:
        signal.signal(signal.SIGUSR1, previous)
    started = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in started)


def test_one_process_plans_and_checks_once(tiny_config, packed_demo, tmp_path, monkeypatch):
    """`anchorctx train` of one process plans the layout, runs the pre-flight checks and reads
    the restart state once each (the launcher passes them to the loop in place)."""
    from anchorctx.training import launch as launch_mod
    from anchorctx.training import loop

    calls: dict[str, int] = {}
    for name in ("plan_parallelism", "preflight", "restart_state"):
        # The launcher imports the loop's functions when it reaches them (node 0 only): those
        # are counted on the loop module, where that import finds them.
        for module in (m for m in (launch_mod, loop) if hasattr(m, name)):
            real = getattr(module, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    cfg = tiny_config.model_copy(
        update={
            "run_root": tmp_path,
            "training": tiny_config.training.model_copy(update={"steps": 1}),
            "data": tiny_config.data.model_copy(update={"output_dir": packed_demo}),
        }
    )
    assert launch_mod.launch(cfg) == 0
    assert calls == {"plan_parallelism": 1, "preflight": 1, "restart_state": 1}
    assert [p.name for p in (cfg.run_dir / "checkpoints").iterdir()] == ["step-000001"]


def test_cuda_training_sets_expandable_segments_unless_the_user_chose():
    from anchorctx.training.launch import CUDA_ALLOC_CONF, cuda_allocator_settings

    env: dict[str, str] = {}
    note = cuda_allocator_settings("cuda", env)
    assert (
        env
        == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}
        == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    assert note and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in note
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert cuda_allocator_settings("cuda", mine) is None
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    cpu: dict[str, str] = {}
    assert cuda_allocator_settings("cpu", cpu) is None and cpu == {}


def test_cuda_ranks_share_the_host_cores_unless_the_user_chose():
    from anchorctx.training.launch import host_threads_settings

    env: dict[str, str] = {}
    note = host_threads_settings("cuda", 2, env, cores=64)
    assert env == {"OMP_NUM_THREADS": "32"}
    assert note and "OMP_NUM_THREADS=32 a rank (64 cores, 2 ranks" in note
    few: dict[str, str] = {}
    host_threads_settings("cuda", 8, few, cores=6)  # more ranks than cores: one each
    assert few == {"OMP_NUM_THREADS": "1"}
    mine = {"OMP_NUM_THREADS": "4"}
    assert (
        host_threads_settings("cuda", 2, mine, cores=64) is None and mine["OMP_NUM_THREADS"] == "4"
    )
    # One rank keeps torch's own default (every core); CPU ranks keep torchrun's 1.
    for device, nproc in (("cuda", 1), ("cpu", 2)):
        env = {}
        assert host_threads_settings(device, nproc, env, cores=64) is None and env == {}
