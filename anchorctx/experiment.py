"""The experiment: the root config that the sections' settings compose, and what is derived
from it (its arms, its pretraining run, its directories).

Every setting of an experiment lives in exactly one place in this tree: each section's schema
beside the code that reads it (``anchorctx/<part>/settings.py``,
``anchorctx/tracking_settings.py``), the mechanism that loads YAML and applies ``--set a.b=value``
overrides in :mod:`anchorctx.config`. YAML files in ``configs/`` are validated against
:class:`ExperimentConfig`. This module imports those settings, the mechanism and the checkpoint
layout only, so loading a config stays light (no torch, transformers or datasets).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from anchorctx.analysis.settings import AnalysisConfig
from anchorctx.config import (
    ConfigError,
    RunName,
    Seed,
    Strict,
    apply_overrides,
    name_problem,
    path_under,
    read_yaml,
    set_dotted,
    to_yaml,
    validate,
)
from anchorctx.evaluation.settings import EvaluationConfig
from anchorctx.models.checkpoints import CHECKPOINT_DIR, checkpoint_name
from anchorctx.models.settings import ModelConfig
from anchorctx.packing.settings import DataConfig
from anchorctx.tracking_settings import TrackingConfig
from anchorctx.training.settings import TrainingConfig, Variant

# Sections that do not change a pretrained model: the pretraining run's directory name hashes
# the rest (evaluation, analysis and tracking settings of the arms never re-pretrain).
_NOT_PRETRAINING = ("evaluation", "analysis", "tracking", "variants", "variant")
# Each config's pretraining run, derived once per content (a dump, the overrides, a hash and a
# validation) however often the arms, the flows and the checks ask. Keyed by the config's JSON
# rather than held on the instance: configs are mutable (validated assignment, sections changed
# in place, model_copy carries private attributes), and a content key never serves a stale one.
_PRETRAINING: OrderedDict[str, ExperimentConfig] = OrderedDict()
_PRETRAINING_CACHED = 32
# Entries of <run_root>/<name>/ that are not runs: an arm of one of these names would share its
# directory with the packed datasets, the report's event files, the stored RULER samples or the
# results of checkpoints outside run_root (evaluation.results, `external/`), and `train --force`
# would move them aside with it.
RESERVED_RUN_NAMES = frozenset({"data", "tensorboard", "ruler-samples", "external"})
# Entries of <run_root>/ that are not experiments (tracking_settings.MlflowConfig's local store).
RESERVED_EXPERIMENT_NAMES = frozenset({"mlflow.db", "mlartifacts"})
# An arm trained under several seeds (``VariantSpec.seeds``) is one run per seed, named
# ``<name>-s<seed>`` (the report pairs the runs of two arms by this suffix).
_SEED_RUN = re.compile(r"(?P<arm>.+)-s(?P<seed>0|[1-9][0-9]*)")


def seed_run_name(name: str, seed: int) -> str:
    """The run directory name of arm ``name`` trained with ``seed``: ``<name>-s<seed>``."""
    return f"{name}-s{seed}"


def seed_run_of(run_name: str) -> tuple[str, int] | None:
    """``(arm, seed)`` of a run named by :func:`seed_run_name`; None for any other name."""
    match = _SEED_RUN.fullmatch(run_name)
    return (match["arm"], int(match["seed"])) if match else None


# ---------------------------------------------------------------------------------- pretrain
class PretrainCorpusConfig(Strict):
    """The generated retrieval-bearing documents (anchorctx.demo.pretrain_corpus)."""

    dir: Path = Path(".demo/pretrain")
    seed: Seed = 0
    documents: int = Field(2000, gt=0, description="Documents, the five kinds in turn.")
    task_format_documents: int = Field(
        0,
        ge=0,
        description="Documents in RULER's task formats besides the five kinds, written by the "
        "project's RULER generator with this corpus' seed over pseudo-word haystacks, fitted "
        "to the pretraining length with model.tokenizer (anchorctx.demo.pretrain_corpus). 0: none.",
    )
    english_haystack_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the essay-haystack tasks' task-format documents written over "
        "English-word prose (RULER's word lists in the corpus' own templates) instead of "
        "pseudo-word prose. 0: none (docs/REPRODUCTION.md, run 6, measured 0.5).",
    )


class PretrainConfig(Strict):
    """Pretrain the base model from scratch before the arms (full-experiment's ``pretrain``
    stage): ``model.tiny`` trained with full attention on ``data.sources`` plus the generated
    retrieval corpus, by the ordinary training loop. Every arm then starts from its last
    checkpoint (``model.path``; the arms' ``model.tiny`` is dropped). The pretraining run is
    ``<run_root>/<name>/pretrain-<hash of its config>/``: a second run reuses it, and its last
    checkpoint is a Hugging Face model directory usable as any config's ``model.path``."""

    corpus: PretrainCorpusConfig = Field(default_factory=PretrainCorpusConfig)
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted overrides that turn the experiment's config into the pretraining "
        "run's, e.g. {'data.seq_len': 2048, 'training.steps': 3000, 'training.lr': 1e-3}. "
        "Applied after the fixed changes: attention full, model.rope_theta, "
        "max_position_embeddings and rope_scaling unset (the model's own RoPE), no domain tags.",
    )


# ---------------------------------------------------------------------------------- experiment
class VariantSpec(Strict):
    """One arm of an experiment: a name, an attention variant, and dotted overrides."""

    name: RunName
    attention: Variant
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted keys, e.g. {'data.domain_tags': true}."
    )
    seeds: list[Seed] | None = Field(
        None,
        description="Train this arm once per training seed, from the same pretrained base: "
        "one run <name>-s<seed> each, with the override seed=<seed> (data order, init). "
        "Expanded when the config loads; None: one run <name> with the experiment's seed.",
    )

    def expand(self) -> list[VariantSpec]:
        """One spec per seed (``seeds``), or this spec alone."""
        if self.seeds is None:
            return [self]
        if not self.seeds:
            raise ValueError(f"variant {self.name!r}: seeds must list at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"variant {self.name!r}: seeds must be distinct: {self.seeds}")
        if "seed" in self.overrides:
            raise ValueError(
                f"variant {self.name!r}: give the training seed by seeds or by the override "
                "seed, not both"
            )
        out = []
        for seed in self.seeds:
            name = seed_run_name(self.name, seed)
            if (problem := name_problem(name)) is not None:
                raise ValueError(f"variant {self.name!r}: run name {name!r} {problem}")
            out.append(
                VariantSpec(
                    name=name, attention=self.attention, overrides={**self.overrides, "seed": seed}
                )
            )
        return out


class ExperimentConfig(Strict):
    name: RunName = Field(description="The experiment: <run_root>/<name>/ (one directory name).")
    run_root: Path = Path("runs")
    seed: Seed = 0
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    pretrain: PretrainConfig | None = Field(
        None, description="Pretrain model.tiny from scratch first; the arms start from it."
    )
    variants: list[VariantSpec] = Field(
        default_factory=list, description="Arms of full-experiment; empty: training.attention."
    )
    variant: RunName | None = Field(
        None, description="Run name under the experiment (set per arm; one directory name)."
    )

    @model_validator(mode="after")
    def _run_names(self) -> ExperimentConfig:
        if any(v.seeds is not None for v in self.variants):
            # In place (a list, so no re-validation): every reader of `variants` (the arms,
            # their provenance, a dumped config) sees one spec per (arm, seed).
            self.variants[:] = [s for v in self.variants for s in v.expand()]
        names = [v.name for v in self.variants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                "variants: names must be distinct (each is a run directory); used more than "
                f"once: {', '.join(map(repr, twice))}"
            )
        if self.name in RESERVED_EXPERIMENT_NAMES:
            raise ValueError(
                f"name: {self.name!r} is reserved (<run_root>/{self.name} is the local MLflow "
                "store); choose another experiment name"
            )
        for key, name in [("variant", self.variant)] + [
            (f"variants.{i}.name", n) for i, n in enumerate(names)
        ]:
            if name in RESERVED_RUN_NAMES:
                raise ValueError(
                    f"{key}: {name!r} is reserved (<run_root>/<name>/{name} holds the "
                    f"experiment's {name}); choose another run name"
                )
        return self

    # -- derived paths ------------------------------------------------------------------
    @property
    def variant_name(self) -> str:
        return self.variant or self.training.attention

    @property
    def experiment_dir(self) -> Path:
        """``<run_root>/<name>/``, checked to lie inside ``run_root`` (config.path_under)."""
        return path_under(self.run_root, self.name, key="name")

    @property
    def run_dir(self) -> Path:
        """``<run_root>/<experiment>/<variant>/`` (docs/ARCHITECTURE.md, run directory contract),
        checked to lie inside ``run_root``: every name in it is one directory name."""
        return path_under(self.run_root, self.name, self.variant_name, key="name/variant")

    def for_variant(self, spec: VariantSpec) -> ExperimentConfig:
        """The config of one experiment arm: overrides applied, attention and name set."""
        raw = self.model_dump(mode="json")
        raw["variants"] = []
        for key, value in spec.overrides.items():
            set_dotted(raw, key, value, what=f"variant {spec.name!r} override {key!r}")
        if raw["seed"] != self.seed and raw["evaluation"]["data_seed"] is None:
            # A training seed: the generated evaluation data stays the experiment's. Arms of
            # other seeds share its directories, and each one's evaluation would otherwise
            # rewrite them with its own seed while the others read
            # (docs/runs/2026-11-27-run-13-seeds-4x-samples.md).
            raw["evaluation"]["data_seed"] = self.seed
        raw["training"]["attention"] = spec.attention
        raw["variant"] = spec.name
        if self.pretrain is not None:  # the arm continues training the pretrained base model
            raw["model"].update(path=str(self.base_model_path), tiny=None, tokenizer=None)
            raw["pretrain"] = None
        return validate(ExperimentConfig, raw, source=f"variant {spec.name!r}")

    def arms(self) -> list[ExperimentConfig]:
        """Every arm of the experiment (a single arm when ``variants`` is empty)."""
        if self.variants:
            return [self.for_variant(v) for v in self.variants]
        if self.pretrain is not None:
            name = self.variant_name
            return [self.for_variant(VariantSpec(name=name, attention=self.training.attention))]
        return [self]

    # -- pretraining ---------------------------------------------------------------------
    def pretraining(self) -> ExperimentConfig:
        """The pretraining run's config (``pretrain`` section): see :class:`PretrainConfig`.
        It keeps the ``pretrain`` section, so the commands that run it write its corpus.

        Derived once per config content; every call on an equal config returns the same
        object, so copy it (``model_copy``) before changing it."""
        if self.pretrain is None:
            raise ConfigError(f"{self.name}: no pretrain section: nothing to pretrain")
        if self.model.tiny is None:
            raise ConfigError("pretrain needs model.tiny (the model to pretrain), not model.path")
        key = self.model_dump_json()
        pre = _PRETRAINING.get(key)
        if pre is None:
            pre = _PRETRAINING[key] = self._derive_pretraining(self.pretrain)
            if len(_PRETRAINING) > _PRETRAINING_CACHED:
                _PRETRAINING.popitem(last=False)
        return pre

    def _derive_pretraining(self, pretrain: PretrainConfig) -> ExperimentConfig:
        raw = self.model_dump(mode="json")
        raw["variants"], raw["variant"] = [], None
        raw["training"]["attention"] = "full"
        raw["model"].update(rope_theta=None, max_position_embeddings=None, rope_scaling={})
        raw["data"]["domain_tags"] = False
        corpus = str(pretrain.corpus.dir / "data")  # pretrain_corpus' layout
        if corpus not in {src["path"] for src in raw["data"]["sources"]}:
            raw["data"]["sources"] = [*raw["data"]["sources"], {"path": corpus}]
        for key, value in pretrain.overrides.items():
            set_dotted(raw, key, value, what=f"pretrain override {key!r}")
        identity = {k: v for k, v in raw.items() if k not in _NOT_PRETRAINING}
        # rope_scaling is always the default here: left out so earlier runs keep their hash.
        identity["model"] = {k: v for k, v in raw["model"].items() if k != "rope_scaling"}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        # The base model is evaluated at the lengths it was trained for (RULER beyond its
        # pretraining length measures nothing but its RoPE base); none of them: no RULER.
        ev = raw["evaluation"]
        fits = [n for n in ev["ruler"]["lengths"] if n <= raw["data"]["seq_len"]]
        if fits:
            ev["ruler"]["lengths"] = fits
        else:
            ev["suites"] = [s for s in ev["suites"] if s != "ruler"]
        raw["variant"] = f"pretrain-{digest[:10]}"
        return validate(ExperimentConfig, raw, source="pretrain")

    @property
    def base_model_path(self) -> Path:
        """The pretraining run's last checkpoint: the arms' ``model.path``."""
        pre = self.pretraining()
        return pre.run_dir / CHECKPOINT_DIR / checkpoint_name(pre.training.steps)

    def to_yaml(self) -> str:
        return to_yaml(self)

    def fingerprint(self, *sections: str) -> str:
        """Content hash of the whole config or of the named top-level sections."""
        dumped = self.model_dump(mode="json")
        if sections:
            dumped = {s: dumped[s] for s in sections}
        return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ loading and overrides
def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML config, apply ``a.b=value`` overrides, validate.

    Relative paths inside the file stay relative to the working directory (like every CLI).
    """
    return config_from_dict(read_yaml(path), overrides, source=str(Path(path)))


def config_from_dict(
    raw: dict[str, Any], overrides: list[str] | None = None, source: str = "config"
) -> ExperimentConfig:
    cfg = validate(ExperimentConfig, apply_overrides(ExperimentConfig, raw, overrides), source)
    # Every arm's overrides are checked now, not when that arm first runs: a typo in a variant
    # fails `config`, a single-arm run and the whole experiment alike. So are the pretraining
    # run's (derived once per content, so this costs the later callers nothing).
    if cfg.pretrain is not None:
        _named(cfg.pretraining, source)
    for spec in cfg.variants:
        _named(lambda spec=spec: cfg.for_variant(spec), source)
    return cfg


def check_layout(cfg: ExperimentConfig, source: str = "config") -> None:
    """Every run of ``cfg`` (its arms and its pretraining run) has batch sizes its processes can
    split, as far as the config tells (``TrainingConfig.layout_problem``); the first that cannot
    is a :class:`ConfigError` naming the key. The CLI runs this on every config it loads, so
    ``anchorctx config`` refuses what ``train`` would refuse at launch."""
    runs = ([cfg.pretraining()] if cfg.pretrain is not None else []) + cfg.arms()
    for run in runs:
        if (problem := run.training.layout_problem()) is not None:
            where = (
                f"variant {run.variant!r}: " if run.variant and run.variant != cfg.variant else ""
            )
            raise ConfigError(f"{source}: {where}{problem}")


def _named(derive: Any, source: str) -> Any:
    """``derive()``, its ConfigError prefixed with the file it came from."""
    try:
        return derive()
    except ConfigError as err:
        if str(err).startswith(f"{source}: "):
            raise
        raise ConfigError(f"{source}: {err}") from None
