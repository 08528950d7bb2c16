"""The Section 2 study on learned weights, with and without the anchor token.

:mod:`anchorctx.analysis.rope_precision` measures the BF16 RoPE discrepancy on one model in
full (every shift, every length). The paper shows it on a pretrained model; this module
measures the same quantities, with the same metric code, on every set of weights an
experiment has:

``random init``  the experiment's ``model`` before any training (``model.tiny``'s init, or the
                 architecture of ``model.path`` with random weights);
``base``         the pretrained model the arms start from: the last checkpoint of the
                 ``pretrain`` stage as the arms load it (their ``model``, RoPE base included),
                 or ``model.path``; without either, the base model *is* the random init and is
                 measured once, as ``base``;
``<arm>``        every arm's final checkpoint (the paper's Figure 1 setting).

Each set of weights runs on two inputs cut from the same text: ``with_anchor`` starts with the
anchor token (BOS at position 0, as the project packs rows) followed by T − 1 text tokens, and
``without_anchor`` is T text tokens with no anchor (``with[1:] == without[:-1]``). Per sequence,
precision mode and input it costs two passes: the reference at Δ2 and the pass at
Δ1 = ``compare_shift``, from which D (Eq. 4), the per-key contributions (first-token share) and
the first-token logit difference at T = ``seq_len`` (Eq. 5) are all computed.

One result file per weights (``<experiment_dir>/rope_precision/weights/<key>.json``, reused
while its :func:`weights_identity` is unchanged); :mod:`anchorctx.analysis.rope_weights_table`
gathers them into one result with a ``weights`` axis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anchorctx.analysis.metrics import column_normalizer, first_token_logits, key_abs_diff
from anchorctx.analysis.probe import capture
from anchorctx.analysis.rope_precision import (
    MODES,
    StudyInputError,
    _forward,
    _highest_fp32_precision,
    _mean_std,
    _packed_token_lists,
    _text_token_lists,
    capture_qk,
    load_study_model,
    sequences_from_token_lists,
    set_mode,
)
from anchorctx.analysis.rope_weights_table import (
    INPUTS,
    SCHEMA_VERSION,
    STUDY,
    WEIGHTS_DIR,
    study_dir,
)
from anchorctx.io import atomic_write_json, hash_tree, read_json, sha256_file
from anchorctx.manifest import code_version
from anchorctx.models.checkpoints import checkpoint_step, list_checkpoints
from anchorctx.models.loading import anchor_token_id, load_tokenizer, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from anchorctx.analysis.settings import RopePrecisionConfig
    from anchorctx.experiment import ExperimentConfig
    from anchorctx.models.settings import ModelConfig

INPUTS_NAME = "inputs.json"


# ------------------------------------------------------------------------------- the weights
@dataclass(frozen=True)
class Weights:
    """One set of weights the study measures."""

    key: str  # file stem: random-init, base, arm-<variant>
    name: str  # the report's row label
    kind: str  # random_init | base | arm
    model: ModelConfig  # how it loads
    random_init: bool  # model.path's architecture with random weights
    label: str

    @property
    def path(self) -> Path | None:
        return None if self.random_init or self.model.path is None else Path(self.model.path)

    def info(self) -> dict[str, Any]:
        path = self.path
        return {
            "key": self.key,
            "name": self.name,
            "kind": self.kind,
            "label": self.label,
            "checkpoint": str(path) if path is not None else None,
            "step": checkpoint_step(path) if path is not None else None,
        }


def weights_list(cfg: ExperimentConfig) -> list[Weights]:
    """Random init, the base model and every arm's final checkpoint, those that exist, in order."""
    arms = cfg.arms()
    out: list[Weights] = []
    if cfg.pretrain is not None:
        out.append(
            Weights(
                "random-init",
                "random init",
                "random_init",
                cfg.model,
                False,
                "model.tiny's initialisation, with the experiment's RoPE settings (those of "
                "the random-init study and the arms)",
            )
        )
        if (cfg.base_model_path / "config.json").is_file():  # once pretrained
            out.append(
                Weights(
                    "base",
                    "base",
                    "base",
                    arms[0].model,
                    False,
                    f"pretrained base model {cfg.base_model_path}, as the arms load it",
                )
            )
    elif cfg.model.path is not None:
        out.append(
            Weights(
                "random-init",
                "random init",
                "random_init",
                cfg.model,
                True,
                f"random weights in the architecture of {cfg.model.path} (seed {cfg.seed})",
            )
        )
        out.append(
            Weights("base", "base", "base", cfg.model, False, f"model.path {cfg.model.path}")
        )
    else:
        out.append(
            Weights(
                "base",
                "base (random init)",
                "base",
                cfg.model,
                False,
                "model.tiny's initialisation: no pretrain stage, the arms start from it",
            )
        )
    for arm in arms:
        checkpoints = list_checkpoints(arm.run_dir)
        if not checkpoints:
            continue
        last = checkpoints[-1]
        model = arm.model.model_copy(update={"path": last, "tiny": None})
        out.append(
            Weights(
                f"arm-{arm.variant_name}",
                arm.variant_name,
                "arm",
                model,
                False,
                f"final checkpoint {last} ({arm.training.attention} attention)",
            )
        )
    return out


def find_weights(cfg: ExperimentConfig, key: str) -> Weights:
    found = {w.key: w for w in weights_list(cfg)}
    if key not in found:
        raise StudyInputError(f"no weights {key!r} in {cfg.name}: {sorted(found)}")
    return found[key]


def result_path(cfg: ExperimentConfig, key: str) -> Path:
    return study_dir(cfg.experiment_dir) / WEIGHTS_DIR / f"{key}.json"


def inputs_path(cfg: ExperimentConfig) -> Path:
    return study_dir(cfg.experiment_dir) / WEIGHTS_DIR / INPUTS_NAME


# -------------------------------------------------------------------------------- the inputs
def anchor_pairs(
    token_lists, anchor: int, n: int, length: int, *, source: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs of ``length``-token sequences from one text stream: ``with_anchor`` is the
    anchor followed by ``length − 1`` text tokens, ``without_anchor`` the same text with no
    anchor, ``length`` tokens (``with[:, 1:] == without[:, :-1]``). Two [n, length] tensors."""
    seqs = sequences_from_token_lists(token_lists, anchor, n, length + 1, source=source)
    return seqs[:, :length].clone(), seqs[:, 1:].clone()


def write_inputs(cfg: ExperimentConfig, *, progress: bool = False) -> Path:
    """Cut the study's with/without-anchor sequences (``analysis.rope_precision``: text files,
    else the first arm's packed dataset) once for every set of weights; returns their file."""
    spec = cfg.analysis.rope_precision
    arm = cfg.arms()[0]  # the arms' tokenizer and data (the experiment's own may not be packed)
    tokenizer = load_tokenizer(arm.model)
    if spec.text_files:
        source = f"text files ({len(spec.text_files)})"
        streams = _text_token_lists(spec.text_files, tokenizer)
    else:
        source = f"the packed dataset of arm {arm.variant_name}"
        streams = _packed_token_lists(arm, progress)
    anchor = anchor_token_id(tokenizer)
    with_anchor, without = anchor_pairs(
        streams, anchor, spec.num_sequences, spec.seq_len, source=source
    )
    data = {
        "source": source,
        "anchor": anchor,
        "with_anchor": with_anchor.tolist(),
        "without_anchor": without.tolist(),
    }
    path = inputs_path(cfg)
    if not (path.is_file() and read_json(path) == data):  # unchanged inputs keep their file
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    return path


# ------------------------------------------------------------------------------ measurement
def compare_pass(
    model: PreTrainedModel, ids: torch.Tensor, shift: int, ref: dict[int, tuple]
) -> tuple[torch.Tensor, float]:
    """One pass at Δ1 = ``shift`` against the reference pass ``ref`` (:func:`capture_qk` at
    Δ2): the per-key contributions c_j of Eq. 4 (float64 [T]) and D_logit of Eq. 5."""
    total = torch.zeros(ids.shape[1], dtype=torch.float64, device=ids.device)
    logit = torch.zeros((), dtype=torch.float64, device=ids.device)

    def diff(layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float) -> None:
        q_ref, k_ref, s_ref = ref[layer]
        total.add_(key_abs_diff(q, k, q_ref, k_ref, scaling)[0])
        z = first_token_logits(q, k, scaling) - first_token_logits(q_ref, k_ref, s_ref)
        logit.add_(z.abs().double().mean(dim=-1).sum())

    with capture(diff):
        _forward(model, ids, shift)
    return total * column_normalizer(ids.shape[1], device=total.device), float(logit)


def _summarise(rows: list[tuple[torch.Tensor, float]]) -> dict[str, Any]:
    d_mean, d_std = _mean_std([float(c.sum()) for c, _ in rows])
    per_token = torch.stack([c.cpu() for c, _ in rows]).mean(dim=0)
    total = float(per_token.sum())
    return {
        "D": d_mean,
        "D_std": d_std,
        "first_token_share": float(per_token[0]) / total if total > 0 else 0.0,
        "D_logit": _mean_std([z for _, z in rows])[0],
        "per_token": per_token.tolist(),
    }


def measure_weights(
    model: PreTrainedModel, inputs: dict[str, torch.Tensor], spec: RopePrecisionConfig
) -> dict[str, dict[str, dict[str, Any]]]:
    """D, first-token share and D_logit at ``spec.compare_shift`` per input and mode.

    ``model``: prepared (:func:`~anchorctx.analysis.rope_precision.prepare_model`); ``inputs``:
    name -> token ids [N, T]. Returns ``{input: {mode: {...}}}`` in the user's mode order."""
    order = [m for m in MODES if m in spec.precisions]  # fp32 first: no lossy casts between modes
    device = next(model.parameters()).device
    out: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in inputs}
    with _highest_fp32_precision(), torch.no_grad():
        for mode in order:
            set_mode(model, mode)
            for name, seqs in inputs.items():
                rows = []
                for seq in seqs:
                    ids = seq[None].to(device)
                    ref = capture_qk(model, ids, spec.delta2)
                    rows.append(compare_pass(model, ids, spec.compare_shift, ref))
                    del ref
                out[name][mode] = _summarise(rows)
    set_mode(model, "fp32")
    return {name: {m: by_mode[m] for m in spec.precisions} for name, by_mode in out.items()}


# ----------------------------------------------------------------------------- entry points
_HASHES: dict[tuple, str] = {}


def _content_hash(path: Path) -> str:
    """Content hash of a model directory, memoised on its files' names, sizes and mtimes."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    key = (
        str(path.resolve()),
        tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files),
    )
    if key not in _HASHES:
        _HASHES[key] = hash_tree(path)
    return _HASHES[key]


def weights_identity(cfg: ExperimentConfig, weights: Weights, inputs: str | Path) -> dict:
    """What a per-weights result depends on: the weights (content hash of their directory, or
    the model config and seed of a random init), the inputs, the settings and the code."""
    spec = cfg.analysis.rope_precision
    path = weights.path
    return {
        "weights": weights.key,
        "model": weights.model.model_dump(mode="json"),
        "random_init": weights.random_init,
        "content": _content_hash(path) if path is not None else None,
        "seed": cfg.seed,
        "inputs": sha256_file(inputs),
        "settings": {
            "delta2": spec.delta2,
            "compare_shift": spec.compare_shift,
            "precisions": list(spec.precisions),
            "device": resolve_device(spec.device, "analysis.rope_precision.device"),
        },
        "code": code_version(),
    }


def _study_cfg(cfg: ExperimentConfig, weights: Weights) -> ExperimentConfig:
    """``cfg`` whose model is these weights (for :func:`load_study_model`)."""
    spec = cfg.analysis.rope_precision.model_copy(update={"random_init": weights.random_init})
    analysis = cfg.analysis.model_copy(update={"rope_precision": spec})
    return cfg.model_copy(update={"model": weights.model, "analysis": analysis})


def run_weights(
    cfg: ExperimentConfig, key: str, inputs: str | Path, *, force: bool = False
) -> Path:
    """Measure the weights ``key`` of :func:`weights_list` on the inputs file of
    :func:`write_inputs`; write and return its result file (reused while its identity holds,
    unless ``force``)."""
    weights = find_weights(cfg, key)
    ident = weights_identity(cfg, weights, inputs)
    out = result_path(cfg, key)
    if not force and out.is_file() and read_json(out).get("identity") == ident:
        return out
    spec = cfg.analysis.rope_precision
    data = read_json(inputs)
    device = torch.device(ident["settings"]["device"])
    start = time.perf_counter()
    tokenizer = load_tokenizer(weights.model)
    if anchor_token_id(tokenizer) != data["anchor"]:
        raise StudyInputError(
            f"{weights.name}: its tokenizer's anchor is {anchor_token_id(tokenizer)}, the "
            f"study's inputs start with {data['anchor']}: the weights use another tokenizer"
        )
    model, _ = load_study_model(_study_cfg(cfg, weights), tokenizer, device)
    seqs = {name: torch.tensor(data[name], dtype=torch.long) for name in INPUTS}
    results = measure_weights(model, seqs, spec)
    del model
    first = seqs[INPUTS[0]]
    result = {
        "schema_version": SCHEMA_VERSION,
        "study": STUDY,
        "weights": weights.info(),
        "settings": {
            "delta2": spec.delta2,
            "compare_shift": spec.compare_shift,
            "seq_len": int(first.shape[1]),
            "num_sequences": int(first.shape[0]),
            "modes": list(spec.precisions),
            "inputs": data["source"],
            "device": device.type,
        },
        "identity": ident,
        "results": results,
        "elapsed_s": round(time.perf_counter() - start, 2),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(out, result)
