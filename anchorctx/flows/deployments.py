"""The deployments ``anchorctx serve`` serves.

- ``full-experiment/demo``: configs/demo.yaml (tiny Llama, generated corpus, CPU);
- ``full-experiment/paper-llama2-64k`` and ``paper-llama2-128k``: configs/paper/llama2-7b-*.yaml
  (Table 1); any other ``configs/paper/<stem>.yaml`` becomes ``full-experiment/paper-<stem>``;
- ``full-experiment/gpu-small``: configs/gpu-small.yaml (a base model pretrained here, the
  four arms at 16K, RULER 2K-16K; one GPU, about 25 minutes); ``full-experiment/gpu-small-sp2``:
  the same on two GPUs with sequence parallelism (:data:`GPU_SMALL_SP2`);
  ``full-experiment/gpu-small-seeds``: intra_doc and anchor under three training seeds from
  gpu-small's base (:data:`GPU_SMALL_SEEDS`); ``full-experiment/gpu-small-seeds-2gpu``: the
  same from nothing on a two-GPU host (:func:`gpu_small_seeds_two_gpus`);
- ``prepare-data/default``, ``train/default``, ``evaluate/default``, ``rope-precision/default``:
  the demo config as the default parameters.

Every parameter is editable per run in the UI. Deployments reference the flows by module path,
so the runner finds them from any working directory; relative paths inside the configs resolve
against the directory ``serve`` runs in.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from anchorctx.experiment import ExperimentConfig, config_from_dict, load_config

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

# Deployment names of the paper presets (others in configs/paper/ get "paper-<stem>").
PAPER_NAMES = {"llama2-7b-64k": "paper-llama2-64k", "llama2-7b-128k": "paper-llama2-128k"}
TAGS = ["anchorctx"]

# full-experiment/gpu-small-sp2: configs/gpu-small.yaml on a two-GPU host, every training run
# (the pretraining and the four arms) split over both GPUs by DeepSpeed-Ulysses (sequence
# parallelism 2, so one data-parallel replica: the same steps, batches and tokens as on one
# GPU), in its own experiment directory.
GPU_SMALL_SP2 = ["name=gpu-small-sp2", "training.nproc=2", "training.sequence_parallel=2"]

# full-experiment/gpu-small-seeds: configs/gpu-small.yaml with the intra_doc and anchor arms each
# trained under training seeds 1, 2 and 3 from the same base (runs intra_doc-s1 ... anchor-s3),
# for the report's "Arm differences over training seeds" (anchor - intra_doc with an interval
# over the seeds). The experiment keeps the name gpu-small, so the pretraining run (its directory
# hashes neither the variants nor the evaluation and analysis settings) and the base model's
# evaluation are the ones gpu-small already made: run after gpu-small, this pretrains nothing.
# Its report replaces runs/gpu-small/report.md (`anchorctx report configs/gpu-small.yaml`
# writes gpu-small's back). RULER only, and no RoPE study, to fit one GPU's 25 minutes; RULER at
# 8K only with 224 samples per task (4x gpu-small's, about the same work as its 2K-16K x 56):
# over gpu-small's lengths the seeds disagreed as much as the arms differ (run 10), and at 8K
# with 4x the samples two to three seeds are the power the difference needs (run 13).
# Arithmetic on an H100 by run 9's timings (docs/runs/2026-11-25-run-09-deterministic-h100.md): 6
# runs x (train 79-88 s + evaluate 94-139 s; those evaluations also ran MMLU and HellaSwag) = 6 x
# 173-227 s = 17.3-22.7 min; three packed 16K datasets (the seed orders the data; the two arms of
# one seed share theirs) ~1 min of CPU; report ~0.5 min: 19-24 min. With no cached base, add run 9's
# 11.2 min of pretraining and 0.9 min of base evaluation: 31-36 min, more than 25.
GPU_SMALL_SEEDS = [
    "variants=[{name: intra_doc, attention: intra_doc, seeds: [1, 2, 3]},"
    " {name: anchor, attention: anchor, seeds: [1, 2, 3]}]",
    "evaluation.suites=[ruler]",
    "evaluation.ruler.lengths=[8192]",
    "evaluation.ruler.num_samples=224",
    "analysis.rope_precision.in_report=false",
]


# full-experiment/gpu-small-seeds-2gpu: GPU_SMALL_SEEDS from nothing (no cached base) on a host
# with two GPUs, in its own experiment directory. The pretraining runs as two data-parallel
# replicas (`training.nproc: 2` among its overrides: the same global batch of 32 rows, 16 a GPU,
# no accumulation, the same 1500 steps), so its base is not gpu-small's (another nproc, another
# pretraining hash). The arms train on one GPU while the finished ones are evaluated on the other
# (evaluation.overlap). Measured on two H100s (run 10, docs/runs/2026-11-26-run-10-three-seeds.md):
# corpora and packing 3.1 min, pretraining 7.1 min (321 s of steps), base evaluation 47 s, each
# arm's training 80-85 s; but each arm's RULER (two shards, both on the one GPU training leaves
# free: ~100 s each with process start and model load) takes about twice an arm's training, so the
# evaluations queue until the last arm has trained. After 27 min one arm's evaluation was still
# unfinished: plan ~30 min. On three H200s (run 13; two evaluate while one trains) it finished in
# 21.4 min, though every arm's RULER merge generated its samples again (the seed-dependent
# evaluation data since fixed, evaluation.data_seed). On three H100s with the fix (run 14): 21.5
# min, each arm's RULER 50-61 s of wall time, the last done 50 s after the last arm trained.
GPU_SMALL_SEEDS_2GPU_NAME = "gpu-small-seeds-2gpu"


def gpu_small_seeds_two_gpus(small: Path) -> ExperimentConfig:
    """configs/gpu-small.yaml with :data:`GPU_SMALL_SEEDS`, its pretraining over two GPUs."""
    raw = load_config(small, [*GPU_SMALL_SEEDS, f"name={GPU_SMALL_SEEDS_2GPU_NAME}"]).model_dump(
        mode="json"
    )
    raw["pretrain"]["overrides"]["training.nproc"] = 2
    return config_from_dict(raw, source=f"{small} ({GPU_SMALL_SEEDS_2GPU_NAME})")


def paper_presets(configs_dir: Path) -> dict[str, Path]:
    """Deployment name -> config file for every ``configs/paper/*.yaml``."""
    return {
        PAPER_NAMES.get(path.stem, f"paper-{path.stem}"): path
        for path in sorted((configs_dir / "paper").glob("*.yaml"))
    }


def _deploy(flow, name: str, cfg: ExperimentConfig, description: str, **params) -> RunnerDeployment:
    from prefect.deployments.runner import EntrypointType

    return flow.to_deployment(
        name=name,
        parameters={"cfg": cfg, **params},
        description=description,
        tags=TAGS,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def build_deployments(
    configs_dir: str | Path = "configs", demo_config: str | Path | None = None
) -> list[RunnerDeployment]:
    """Every deployment, with its config validated now (a broken preset fails ``serve``)."""
    from anchorctx.flows import experiment as fx

    configs_dir = Path(configs_dir)
    demo_path = Path(demo_config) if demo_config else configs_dir / "demo.yaml"
    demo = load_config(demo_path)
    deployments = [
        _deploy(
            fx.full_experiment,
            "demo",
            demo,
            f"The whole experiment on {demo_path}: every arm trained, evaluated, compared.",
        ),
        _deploy(fx.prepare_data_flow, "default", demo, f"Pack the data of {demo_path}."),
        _deploy(fx.train_flow, "default", demo, f"Train one arm of {demo_path}."),
        _deploy(
            fx.evaluate_flow,
            "default",
            demo,
            "Evaluate the existing checkpoints of a run (cached per checkpoint and suite).",
        ),
        _deploy(fx.rope_precision_flow, "default", demo, "BF16 vs FP32 RoPE precision study."),
    ]
    if (small := configs_dir / "gpu-small.yaml").is_file():
        deployments.append(
            _deploy(
                fx.full_experiment,
                "gpu-small",
                load_config(small),
                f"{small}: pretrain a ~150M Llama, then the four arms at 16K, on one GPU.",
            )
        )
        deployments.append(
            _deploy(
                fx.full_experiment,
                "gpu-small-sp2",
                load_config(small, GPU_SMALL_SP2),
                f"{small} with {' '.join(GPU_SMALL_SP2)}: the same comparison "
                "with DeepSpeed-Ulysses over two GPUs.",
            )
        )
        deployments.append(
            _deploy(
                fx.full_experiment,
                "gpu-small-seeds",
                load_config(small, GPU_SMALL_SEEDS),
                f"{small}: intra_doc and anchor under training seeds 1-3 from gpu-small's base "
                "(run after gpu-small: ~24 min on one GPU), their difference over the seeds.",
            )
        )
        deployments.append(
            _deploy(
                fx.full_experiment,
                GPU_SMALL_SEEDS_2GPU_NAME,
                gpu_small_seeds_two_gpus(small),
                f"{small}: gpu-small-seeds from nothing on two GPUs (~30 min): pretraining over "
                "both, each arm trained on one while the other evaluates the finished ones.",
            )
        )
    for name, path in paper_presets(configs_dir).items():
        cfg = load_config(path)
        deployments.append(
            _deploy(
                fx.full_experiment,
                name,
                cfg,
                f"Paper preset {path}: point model.path and data.sources at local copies first.",
            )
        )
    return deployments
