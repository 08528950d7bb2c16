"""The training process finds its own environment's build tools (training/deepspeed_env.py)."""

from __future__ import annotations

import os
import sys

from anchorctx.training.deepspeed_env import environment_tools_first


def _bindir_with(tmp_path, *names):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    for name in names:
        (bindir / name).write_text("")
    return bindir


def test_the_interpreters_ninja_comes_first(tmp_path, monkeypatch):
    """Started without its virtualenv on PATH (a Prefect task, `.venv/bin/python -m ...`), the
    process puts the interpreter's bin directory first, once, so DeepSpeed's JIT build runs the
    locked ninja that built the cached ops, not another one that would rebuild them."""
    bindir = _bindir_with(tmp_path, "python", "ninja")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin"]))
    environment_tools_first()
    assert os.environ["PATH"].split(os.pathsep) == [str(bindir), "/usr/local/bin", "/usr/bin"]
    environment_tools_first()  # already first: unchanged
    assert os.environ["PATH"].split(os.pathsep) == [str(bindir), "/usr/local/bin", "/usr/bin"]


def test_path_is_left_alone_without_a_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    """A system Python (no ninja of its own): PATH's ninja is the only one there is."""
    bindir = _bindir_with(tmp_path, "python")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin")
    environment_tools_first()
    assert os.environ["PATH"] == "/usr/bin"


_GPU_HOST = """
import os, sys, torch
torch.cuda.device_count = lambda: 1  # what DeepSpeed's detection sees on a GPU host
torch.cuda.is_available = lambda: True
os.environ.pop("DS_ACCELERATOR", None)
from anchorctx.training.deepspeed_env import use_accelerator
if sys.argv[1] == "fixed":
    use_accelerator("cpu")
from deepspeed.accelerator import get_accelerator
print(get_accelerator().device_name())
if sys.argv[1] == "fixed":
    use_accelerator("cuda")  # a later GPU run in the same process switches back
    print(get_accelerator().device_name())
    use_accelerator("cpu")
    print(get_accelerator().device_name())
"""


def test_a_cpu_run_on_a_gpu_host_uses_deepspeeds_cpu_accelerator():
    """DeepSpeed detects CUDA wherever a GPU is visible and moves the model there; a run with
    training.device cpu (the demo) on a GPU host must keep it on the CPU. Simulated on this
    CPU machine by making torch report a GPU before DeepSpeed is imported."""
    import subprocess

    # Both interpreters at once (each spends seconds importing torch and DeepSpeed).
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _GPU_HOST, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in ("detected", "fixed")
    }

    def accelerators(mode: str) -> list[str]:
        out, err = procs[mode].communicate(timeout=300)
        assert procs[mode].returncode == 0, err[-3000:]
        return out.split()

    assert accelerators("detected") == ["cuda"]  # the failure this guards against
    assert accelerators("fixed") == ["cpu", "cuda", "cpu"]


_IMPORT_DEEPSPEED = """
import sys
from anchorctx.training.deepspeed_env import import_deepspeed
import_deepspeed()
from deepspeed.autotuning import autotuner
print("result:", "mlflow" in sys.modules, autotuner.has_mlflow)
import mlflow  # the tracker's import, later in the same process
print("result:", type(mlflow.MlflowClient).__name__)
"""


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner imports MLflow at module level (1.2 s of CPU per training process,
    for a feature the project never runs): import_deepspeed keeps MLflow out of that import
    only; the tracker's own import afterwards gets the real package. In a fresh interpreter
    (this one may have both loaded already)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_DEEPSPEED], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # DeepSpeed prints its accelerator warning to stdout too: only the lines this script wrote.
    got = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("result:")]
    assert got == [["False", "False"], ["type"]], out.stdout[-3000:]
