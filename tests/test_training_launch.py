"""``anchorctx train`` with ``training.sequence_parallel=2`` on CPU launches two gloo processes
(torchrun child) and trains exactly like one process."""

from __future__ import annotations

import pytest
import torch
from distributed import torch_extensions  # noqa: F401  (fixture)
from safetensors.torch import load_file

from anchorctx.cli import main
from anchorctx.io import read_jsonl


@pytest.mark.distributed
def test_cli_sp2_launch_matches_one_process(tiny_config, packed_demo, tmp_path, torch_extensions):  # noqa: F811
    config = tmp_path / "config.yaml"
    config.write_text(tiny_config.to_yaml())
    common = ["--set", "training.steps=2",
              "--set", f"data.output_dir={packed_demo}", "--set", f"run_root={tmp_path}"]  # fmt: skip
    assert main(["train", str(config), *common, "--set", "name=one"]) == 0
    assert main(["train", str(config), *common, "--set", "name=two",
                 "--set", "training.sequence_parallel=2"]) == 0  # fmt: skip
    one, two = (tmp_path / n / "anchor" for n in ("one", "two"))
    manifest = (two / "manifest.json").read_text()
    assert '"sp": 2' in manifest and '"world": 2' in manifest
    a = load_file(one / "checkpoints" / "step-000002" / "model.safetensors")
    b = load_file(two / "checkpoints" / "step-000002" / "model.safetensors")
    for name, ref in a.items():
        rel = torch.linalg.vector_norm(b[name] - ref) / torch.linalg.vector_norm(ref)
        assert rel <= 1e-6, f"{name}: {rel:.2e}"
    loss_a = [r["loss"] for r in read_jsonl(one / "metrics.jsonl")]
    loss_b = [r["loss"] for r in read_jsonl(two / "metrics.jsonl")]
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
