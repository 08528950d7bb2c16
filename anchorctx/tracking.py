"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, configured once (``tracking``).

Every stage opens one tracked run per arm and stage and logs to every configured backend:

- ``train``: each step's numbers under ``train/`` (loss, grad norm, lr, tokens/s, MFU, peak
  memory, ...), step = optimiser step;
- ``evaluate`` and ``report``: see :mod:`anchorctx.evaluation.tracking`.

Each run carries a name (``<experiment>-<variant>-<stage>``), tags (experiment, variant,
attention, stage, plus ``tracking.tags``) and the resolved config. Where the data goes:
TensorBoard event files in ``<run_dir>/tensorboard``; MLflow to ``MLFLOW_TRACKING_URI`` when
set, else a local SQLite store ``<run_root>/mlflow.db`` (MLflow 3 refuses new plain-file stores);
W&B offline under ``<run_dir>/wandb`` unless ``WANDB_MODE`` (or ``tracking.wandb.mode``) says
otherwise. Each backend's package is optional and imported only when selected.

Only rank 0 of a training launch opens a tracker (the loop passes ``enabled=False`` elsewhere).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anchorctx.experiment import ExperimentConfig

log = logging.getLogger(__name__)

# backend -> (module that must import, what to install)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny (or mlflow)"),
    "wandb": ("wandb", "wandb"),
}


class TrackingError(RuntimeError):
    """A selected tracking backend cannot be used; the message names the package to install."""

    exit_code = 2  # fix the setup or the config (anchorctx.cli)


def check_backends(cfg: ExperimentConfig) -> None:
    """Fail fast (before any work) when a selected backend's package is not installed."""
    for backend in cfg.tracking.backends:
        module, install = PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise TrackingError(
                f"tracking backend {backend!r} (config key tracking) needs the {module!r} "
                f"package: pip install {install}, or pip install 'anchorctx[tracking]'"
            )


def run_name(cfg: ExperimentConfig, stage: str) -> str:
    return f"{cfg.name}-{stage}" if stage == "report" else f"{cfg.name}-{cfg.variant_name}-{stage}"


def run_tags(cfg: ExperimentConfig, stage: str) -> dict[str, str]:
    """Key/value tags (MLflow); W&B and TensorBoard get them as ``key:value`` strings."""
    tags = {"anchorctx.experiment": cfg.name, "anchorctx.stage": stage}
    if stage != "report":
        tags |= {
            "anchorctx.variant": cfg.variant_name,
            "anchorctx.attention": cfg.training.attention,
        }
    tags["anchorctx.config_hash"] = cfg.fingerprint()
    return tags | {t: "true" for t in cfg.tracking.tags}


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: obj}


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among ``metrics`` (None, e.g. MFU on CPU, is left out, not zeroed)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and v == v
        and abs(v) != float("inf")
    }


def _writable_dir(path: Path, backend: str) -> None:
    """Create ``path`` and write a probe file in it, here: TensorBoard writes its event file from
    a thread of its own, where a read-only directory is a traceback after the work is done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        raise TrackingError(
            f"tracking backend {backend!r} cannot write to {path}: {err.strerror or err}"
        ) from None


# ------------------------------------------------------------------------------- backends
class _TensorBoard:
    def __init__(self, cfg: ExperimentConfig, stage: str, log_dir: Path) -> None:
        # Imported here: torch.utils.tensorboard imports torch; each backend loads only when it is
        # configured.
        from torch.utils.tensorboard import SummaryWriter

        root = cfg.tracking.tensorboard.log_dir
        leaf = "report" if stage == "report" else cfg.variant_name
        self.dir = root / cfg.name / leaf if root is not None else log_dir
        _writable_dir(self.dir, "tensorboard")
        self.writer = SummaryWriter(str(self.dir))
        tags = run_tags(cfg, stage)
        self.writer.add_text(f"{stage}/run", "\n".join(f"- {k}: {v}" for k, v in tags.items()))
        # Four-space indent: TensorBoard renders text as Markdown; keep the YAML verbatim.
        self.writer.add_text(f"{stage}/config", "    " + cfg.to_yaml().replace("\n", "\n    "))

    def metrics(self, values: dict[str, float], step: int | None) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.writer.add_text(key, "\n".join(lines))

    def image(self, key: str, path: Path) -> None:
        # Imported here: matplotlib loads only when a figure is drawn.
        import matplotlib.image

        pixels = matplotlib.image.imread(str(path))  # [H, W, C] floats in [0, 1] for a PNG
        self.writer.add_image(key, pixels[..., :3], dataformats="HWC")

    def text(self, key: str, text: str) -> None:
        self.writer.add_text(key, text)

    def close(self) -> None:
        self.writer.close()


class _Mlflow:
    def __init__(self, cfg: ExperimentConfig, stage: str, log_dir: Path) -> None:
        # Imported here: an optional backend, loaded only when it is configured.
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        opts = cfg.tracking.mlflow
        uri = opts.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            root = cfg.run_root.resolve()
            root.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{root / 'mlflow.db'}"
            artifacts = (root / "mlartifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = opts.experiment or cfg.name
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
            except Exception:  # another process created it first (stages run concurrently)
                experiment_id = self.client.get_experiment_by_name(name).experiment_id  # type: ignore[union-attr]  # it exists: creating it failed
        else:
            experiment_id = experiment.experiment_id
        run = self.client.create_run(
            experiment_id, run_name=run_name(cfg, stage), tags=run_tags(cfg, stage)
        )
        self.run_id = run.info.run_id
        self.uri = uri
        # MLflow params are strings of at most 6000 characters; the full YAML goes in as text.
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, cfg.to_yaml(), "config.yaml")

    def metrics(self, values: dict[str, float], step: int | None) -> None:
        # Imported here: an optional backend, loaded only when it is configured.
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step or 0) for k, v in values.items()]
        for i in range(0, len(batch), 1000):  # log_batch's per-call metric limit
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{key}.json")

    def image(self, key: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def text(self, key: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{key}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    def __init__(self, cfg: ExperimentConfig, stage: str, log_dir: Path) -> None:
        # Imported here: an optional backend, loaded only when it is configured.
        import wandb

        opts = cfg.tracking.wandb
        mode = opts.mode or os.environ.get("WANDB_MODE") or "offline"
        folder = log_dir.parent  # wandb writes <dir>/wandb/<run>
        folder.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=opts.project or cfg.name,
            entity=opts.entity,
            name=run_name(cfg, stage),
            group=cfg.name if stage == "report" else f"{cfg.name}-{cfg.variant_name}",
            job_type=stage,
            tags=[
                f"{k.removeprefix('anchorctx.')}:{v}" if v != "true" else k
                for k, v in run_tags(cfg, stage).items()
            ][:64],
            config=cfg.model_dump(mode="json"),
            dir=str(folder),
            mode=mode,  # type: ignore[arg-type]  # wandb checks it (online, offline, disabled)
            reinit="create_new",
            # console capture would wrap this process's stdout (the training log, which the
            # Prefect task streams); system stats start a sampler process per run.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def metrics(self, values: dict[str, float], step: int | None) -> None:
        self.run.log(values, step=step)

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.wandb.Table(columns=list[str | int](columns), data=rows)})

    def image(self, key: str, path: Path) -> None:
        self.run.log({key: self.wandb.Image(str(path))})

    def text(self, key: str, text: str) -> None:
        self.run.summary[key] = text

    def close(self) -> None:
        self.run.finish()


BACKENDS = {"tensorboard": _TensorBoard, "mlflow": _Mlflow, "wandb": _Wandb}


class Tracker:
    """Fan-out to the configured backends; a no-op when none is configured or not ``enabled``.

    ``log_dir``: where local files go (default: ``<run_dir>/tensorboard``; the report stage
    passes ``<experiment_dir>/tensorboard``). W&B uses its parent folder."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        stage: str,
        *,
        enabled: bool = True,
        log_dir: Path | None = None,
    ) -> None:
        self.backends: list[Any] = []
        if not enabled or not cfg.tracking.backends:
            return
        check_backends(cfg)
        log_dir = log_dir or cfg.run_dir / "tensorboard"
        try:
            for name in cfg.tracking.backends:
                self.backends.append(BACKENDS[name](cfg, stage, log_dir))
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self.backends)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metrics(self, values: dict[str, Any], step: int | None = None) -> None:
        numbers = _numbers(values)
        if numbers:
            for b in self.backends:
                b.metrics(numbers, step)

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        for b in self.backends:
            b.table(key, columns, rows)

    def image(self, key: str, path: str | Path) -> None:
        for b in self.backends:
            b.image(key, Path(path))

    def text(self, key: str, text: str) -> None:
        for b in self.backends:
            b.text(key, text)

    def close(self) -> None:
        backends, self.backends = self.backends, []
        for b in backends:
            try:
                b.close()
            except Exception as err:  # one backend failing to flush must not lose the others
                log.warning("closing tracker %s failed: %s", type(b).__name__, err)


# ------------------------------------------------------------------------ what stages log
def train_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` row as tracked metrics (``train/<key>``)."""
    return {f"train/{k}": v for k, v in row.items() if k != "step"}
