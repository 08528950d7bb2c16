"""The ``tracking`` section: TensorBoard, MLflow and W&B settings. Read by
:mod:`anchorctx.tracking` (kept apart from it so the config loads without the backends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from anchorctx.config import Strict

TrackingBackend = Literal["tensorboard", "mlflow", "wandb"]


class TensorBoardConfig(Strict):
    log_dir: Path | None = Field(
        None,
        description="One folder for every run: <log_dir>/<name>/<variant or 'report'>. Default: "
        "<run_dir>/tensorboard per arm, <experiment_dir>/tensorboard for the report.",
    )


class MlflowConfig(Strict):
    tracking_uri: str | None = Field(
        None,
        description="Default: MLFLOW_TRACKING_URI, else a local store "
        "sqlite:///<run_root>/mlflow.db (MLflow 3 refuses plain file stores) with artifacts in "
        "<run_root>/mlartifacts.",
    )
    experiment: str | None = Field(None, description="MLflow experiment. Default: name.")


class WandbConfig(Strict):
    project: str | None = Field(None, description="Default: name.")
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="Default: WANDB_MODE, else offline (files under <run_dir>/wandb)."
    )


class TrackingConfig(Strict):
    """Experiment trackers every stage logs to (training, evaluation, report); rank 0 only.

    ``tracking: [tensorboard, mlflow]`` in YAML is short for ``tracking: {backends: [...]}``.
    """

    backends: list[TrackingBackend] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list, description="Extra tags on every tracked run.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, value: Any) -> Any:
        return {"backends": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _distinct(self) -> TrackingConfig:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"tracking backends must be distinct (got {self.backends})")
        return self
