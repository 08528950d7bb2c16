"""The BF16 RoPE precision study (Wang et al., "When Precision Meets Position", Section 2).

RoPE makes attention depend only on relative positions, so shifting every position id of a
sequence by the same constant must leave attention unchanged. In bf16 it does not. The study
measures by how much, on the same weights in several precision modes:

``fp32``            float32 parameters and activations (the exact reference);
``bf16``            bfloat16 parameters and activations, stock RoPE (what the authors train with);
``bf16_rope_fp32``  bfloat16 with ``model.rope_fp32`` (:mod:`anchorctx.models.rope`).

Our reading of the paper's definitions (stated here because every number depends on it):

* Eq. 4, attention difference. For input X (T tokens) run the model twice, with position ids
  ``Δ1 + [0..T−1]`` and ``Δ2 + [0..T−1]``. For layer l and head h let ``A^{Δ}_{l,h}`` be the
  causal attention-probability matrix [T, T] (queries × keys). The absolute difference is
  summed over queries per key column and normalised by ``n = [1/T, 1/(T−1), …, 1]`` (key j is
  visible to T − j queries), giving per-key contributions
  ``c_j = Σ_{l,h} n_j Σ_i |A^{Δ1}_{l,h}[i, j] − A^{Δ2}_{l,h}[i, j]|``, and
  ``D(X, Δ1, Δ2) = Σ_j c_j``, averaged over the N input sequences. Δ2 = 16 and Δ1 runs over the
  paper's list plus 16 itself, where D is exactly 0 (the two passes are identical computations).
* Figure 1 middle: the per-key contributions ``c_j`` for Δ1 = 0 against Δ2 = 16;
  ``first_token_share`` is ``c_0 / Σ_j c_j``, the share of D contributed by key token 0.
* Eq. 5, first-token logit difference. With ``z^{Δ}_{l,h}[i] = q_i · k_0 / sqrt(d)`` the
  pre-softmax logit of query i on key token 0,
  ``D_logit(X) = Σ_{l,h} mean_i |z^{Δ1}_{l,h}[i] − z^{Δ2}_{l,h}[i]|`` with Δ1 = 0, Δ2 = 16, for
  sequence lengths T = 64 … 8192 (the first T tokens of each sequence), averaged over sequences.

Measurement details: q/k are captured where the model's attention kernel receives them
(:mod:`anchorctx.analysis.probe`), i.e. after the model's own RoPE and dtype casts; the
probabilities and logits are then evaluated in float32 (accumulated in float64), so the
measurement adds no rounding of its own and a difference in the ``fp32`` mode is float32
rounding only. Both precisions use bit-identical weights: parameters are rounded to the bf16
grid once, the ``fp32`` mode runs them in float32 and the bf16 modes cast them losslessly. As in
``load_model(dtype="bfloat16")``, only parameters are cast; the rotary ``inv_freq`` buffer stays
float32. Sliding-window models are measured with a plain causal mask (exact for T ≤ window).
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from anchorctx.analysis.metrics import column_normalizer, first_token_logits, key_abs_diff
from anchorctx.analysis.plot import plot_per_sample, plot_study
from anchorctx.analysis.probe import capture, register
from anchorctx.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from anchorctx.manifest import base_manifest
from anchorctx.models.loading import (
    anchor_token_id,
    build_hf_config,
    load_model,
    load_tokenizer,
    resolve_device,
)
from anchorctx.models.rope import disable_fp32_rope, enable_fp32_rope
from anchorctx.packing import load_packed, prepare_data

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from anchorctx.analysis.settings import RopePrecisionConfig
    from anchorctx.experiment import ExperimentConfig

MODES = ("fp32", "bf16", "bf16_rope_fp32")
JSON_NAME = "rope_precision.json"
PNG_NAME = "rope_precision.png"
MD_NAME = "rope_precision.md"
# Figure 7: the shift curve of every sequence (the main JSON keeps only their mean and std).
PER_SAMPLE_JSON = "rope_precision_per_sample.json"
PER_SAMPLE_PNG = "rope_precision_per_sample.png"
PER_SAMPLE_KEY = "per_sample_shift_curve"  # in measure()'s result; write_study moves it out
SCHEMA_VERSION = 1


class StudyInputError(ValueError):
    """The study's inputs (sequences, lengths, model) cannot give the requested measurement."""


# ------------------------------------------------------------------------------ model and modes
def set_mode(model: PreTrainedModel, mode: str) -> None:
    """Put the (bf16-grid) model into one precision mode: parameter dtype and RoPE path."""

    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}; choose from {', '.join(MODES)}")
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    for p in model.parameters():
        p.data = p.data.to(dtype)  # lossless both ways: the values lie on the bf16 grid
    if mode == "bf16_rope_fp32":
        enable_fp32_rope(model)
    else:
        disable_fp32_rope(model)


def round_to_bf16_grid(model: PreTrainedModel) -> None:
    """Round every parameter to bf16 precision (kept float32) so all modes share weights."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).to(torch.float32)


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Select the probe attention, freeze, and round weights to the shared bf16 grid."""

    model.set_attn_implementation(register())
    model.eval().requires_grad_(False)
    round_to_bf16_grid(model)
    return model


# ---------------------------------------------------------------------------- one forward pass
def _forward(model: PreTrainedModel, ids: torch.Tensor, shift: int) -> None:
    """Run the decoder (no LM head) on ids [1, T] with position ids shift + [0..T-1]."""
    positions = torch.arange(shift, shift + ids.shape[1], device=ids.device).unsqueeze(0)
    model.base_model(input_ids=ids, position_ids=positions, use_cache=False)


def capture_qk(model: PreTrainedModel, ids: torch.Tensor, shift: int) -> dict[int, tuple]:
    """Per layer: (q [1, H, T, D], k [1, H_kv, T, D], scaling) of one pass."""
    store: dict[int, tuple] = {}

    def keep(layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float) -> None:
        store[layer] = (q.detach(), k.detach(), scaling)

    with capture(keep):
        _forward(model, ids, shift)
    return store


def key_contributions(
    model: PreTrainedModel, ids: torch.Tensor, shift: int, ref: dict[int, tuple]
) -> torch.Tensor:
    """c_j of Eq. 4 for (Δ1 = shift, Δ2 = the reference pass): float64 [T]."""
    total = torch.zeros(ids.shape[1], dtype=torch.float64, device=ids.device)

    def diff(layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float) -> None:
        q_ref, k_ref, _ = ref[layer]
        total.add_(key_abs_diff(q, k, q_ref, k_ref, scaling)[0])

    with capture(diff):
        _forward(model, ids, shift)
    return total * column_normalizer(ids.shape[1], device=total.device)


def _first_token_logits(
    model: PreTrainedModel, ids: torch.Tensor, shift: int
) -> dict[int, torch.Tensor]:
    """Per layer: logits of every query on key token 0, [1, H, T] float32 (q/k not kept)."""
    store: dict[int, torch.Tensor] = {}

    def keep(layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float) -> None:
        store[layer] = first_token_logits(q, k, scaling)

    with capture(keep):
        _forward(model, ids, shift)
    return store


def first_token_logit_diff(
    model: PreTrainedModel, ids: torch.Tensor, delta1: int, delta2: int
) -> float:
    """D_logit of Eq. 5 for one sequence: Σ_{layers, heads} mean_i |z^{Δ1}[i] − z^{Δ2}[i]|."""
    z1, z2 = _first_token_logits(model, ids, delta1), _first_token_logits(model, ids, delta2)
    return sum(float((z1[layer] - z2[layer]).abs().double().mean(dim=-1).sum()) for layer in z2)


# ------------------------------------------------------------------------------- the study loop
def _shifts(spec: RopePrecisionConfig) -> list[int]:
    return sorted(set(spec.shifts) | {spec.compare_shift})


def passes_per_sequence(spec: RopePrecisionConfig) -> int:
    return 1 + len(_shifts(spec)) + 2 * len(spec.lengths)


def _sequence_metrics(model, ids: torch.Tensor, spec: RopePrecisionConfig, bar) -> dict[str, Any]:
    """Shift curve, per-key contributions and D_logit by length for one sequence [1, ≥T]."""
    head = ids[:, : spec.seq_len]
    ref = capture_qk(model, head, spec.delta2)
    bar.update(1)
    curve, per_token = {}, None
    for delta1 in _shifts(spec):
        contrib = key_contributions(model, head, delta1, ref)
        curve[delta1] = float(contrib.sum())
        if delta1 == spec.compare_shift:
            per_token = contrib.cpu()
        bar.update(1)
    del ref
    logit = {}
    for length in spec.lengths:
        logit[length] = first_token_logit_diff(
            model, ids[:, :length], spec.compare_shift, spec.delta2
        )
        bar.update(2)
    return {"curve": curve, "per_token": per_token, "logit": logit}


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return mean, math.sqrt(var)


def _aggregate(rows: list[dict[str, Any]], spec: RopePrecisionConfig) -> dict[str, Any]:
    """Mean (and std) over sequences of one mode's per-sequence metrics, and the per-sequence
    shift curves themselves (Figure 7), whose mean is ``shift_curve`` by construction."""
    per_sample = [{str(d): r["curve"][d] for d in _shifts(spec)} for r in rows]
    curve = {d: _mean_std([c[str(d)] for c in per_sample]) for d in _shifts(spec)}
    logit = {n: _mean_std([r["logit"][n] for r in rows]) for n in spec.lengths}
    per_token = torch.stack([r["per_token"] for r in rows]).mean(dim=0)
    total = float(per_token.sum())
    return {
        "shift_curve": {str(d): m for d, (m, _) in curve.items()},
        "shift_curve_std": {str(d): s for d, (_, s) in curve.items()},
        "logit_diff_by_length": {str(n): m for n, (m, _) in logit.items()},
        "logit_diff_by_length_std": {str(n): s for n, (_, s) in logit.items()},
        "per_token": per_token.tolist(),
        "first_token_share": float(per_token[0]) / total if total > 0 else 0.0,
        PER_SAMPLE_KEY: per_sample,
    }


def measure(
    model: PreTrainedModel,
    sequences: torch.Tensor,
    spec: RopePrecisionConfig,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the study on a prepared model (:func:`prepare_model`) and token ids [N, ≥T].

    Returns the result mapping written to ``rope_precision.json`` (without config/manifest);
    its per-sequence shift curves (``per_sample_shift_curve``) go to
    ``rope_precision_per_sample.json`` instead (:func:`write_study`).
    """

    need = max(spec.seq_len, *spec.lengths)
    if sequences.ndim != 2 or sequences.shape[1] < need:
        raise StudyInputError(
            f"sequences must be [N, >= {need}] token ids (max of seq_len and lengths), "
            f"got {tuple(sequences.shape)}"
        )
    order = [m for m in MODES if m in spec.precisions]  # fp32 first: no lossy casts between modes
    device = next(model.parameters()).device
    per_mode: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    total = len(order) * len(sequences) * passes_per_sequence(spec)
    with (
        _highest_fp32_precision(),
        torch.no_grad(),
        tqdm(
            total=total,
            desc="rope-precision",
            unit="pass",
            disable=not progress,
            dynamic_ncols=True,
        ) as bar,
    ):
        for mode in order:
            set_mode(model, mode)
            bar.set_postfix_str(mode)
            rows = [_sequence_metrics(model, seq[None].to(device), spec, bar) for seq in sequences]
            per_mode[mode] = _aggregate(rows, spec)
    set_mode(model, "fp32")
    return _assemble(
        per_mode, spec, num_sequences=len(sequences), seconds=time.perf_counter() - start
    )


def _assemble(
    per_mode: dict, spec: RopePrecisionConfig, *, num_sequences: int, seconds: float
) -> dict:
    modes = [m for m in spec.precisions if m in per_mode]  # the user's order
    keys = (
        "shift_curve",
        "shift_curve_std",
        "first_token_share",
        "per_token",
        "logit_diff_by_length",
        "logit_diff_by_length_std",
        PER_SAMPLE_KEY,
    )
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "study": "rope_precision",
        "settings": {
            "delta2": spec.delta2,
            "compare_shift": spec.compare_shift,
            "shifts": _shifts(spec),
            "seq_len": spec.seq_len,
            "lengths": list(spec.lengths),
            "num_sequences": num_sequences,
            "modes": modes,
        },
        "rope_fp32": {m: m == "bf16_rope_fp32" for m in modes},
        "elapsed_s": round(seconds, 2),
    }
    for key in keys:
        out[key] = {m: per_mode[m][key] for m in modes}
    return out


@contextlib.contextmanager
def _highest_fp32_precision() -> Iterator[None]:
    """fp32 matmuls in full precision (no TF32) for the duration of the study."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


# --------------------------------------------------------------------------------- input tokens
def sequences_from_token_lists(
    token_lists: Iterable[Sequence[int]], anchor: int, n: int, length: int, *, source: str
) -> torch.Tensor:
    """Cut ``n`` sequences of ``length`` tokens, each ``[anchor] + length−1 tokens``, from a
    stream of documents (concatenated in order). [n, length] int64."""
    body = length - 1
    out: list[list[int]] = []
    buffer: list[int] = []
    for tokens in token_lists:
        buffer.extend(int(t) for t in tokens)
        while len(buffer) >= body and len(out) < n:
            out.append([anchor, *buffer[:body]])
            buffer = buffer[body:]
        if len(out) == n:
            return torch.tensor(out, dtype=torch.long)
    raise StudyInputError(
        f"{source} holds {len(out)} sequence(s) of {length} tokens, {n} requested: lower "
        "analysis.rope_precision.num_sequences, seq_len or lengths, or supply more text"
    )


def _text_token_lists(paths: Sequence[Path], tokenizer) -> Iterable[list[int]]:
    for path in paths:
        if not Path(path).is_file():
            raise StudyInputError(f"analysis.rope_precision.text_files: no such file {path}")
        yield tokenizer(Path(path).read_text(), add_special_tokens=False)["input_ids"]


def _packed_token_lists(cfg: ExperimentConfig, progress: bool) -> Iterable[list[int]]:
    """Rows of the experiment's packed dataset, each without its leading anchor token."""

    dataset, _ = load_packed(prepare_data(cfg, progress=progress))
    for row in dataset:
        yield row["input_ids"][1:]


def load_sequences(
    cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase, *, progress: bool = True
) -> tuple[torch.Tensor, str]:
    """The study's token ids [N, max(seq_len, lengths)] and a description of their source.

    Documents (text files, or packed rows without their anchor) are concatenated and cut into
    windows that each start with the anchor token (BOS), like a packed training row.
    """

    spec = cfg.analysis.rope_precision
    length = max(spec.seq_len, *spec.lengths)
    if spec.text_files:
        source = f"text files ({len(spec.text_files)})"
        streams = _text_token_lists(spec.text_files, tokenizer)
    else:
        source = "packed dataset"
        streams = _packed_token_lists(cfg, progress)
    anchor = anchor_token_id(tokenizer)
    return sequences_from_token_lists(
        streams, anchor, spec.num_sequences, length, source=source
    ), source


def random_sequences(n: int, length: int, vocab_size: int, anchor: int, seed: int) -> torch.Tensor:
    """Seeded uniform random token ids [n, length] starting with the anchor (benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, length), generator=gen)
    ids[:, 0] = anchor
    return ids


# ---------------------------------------------------------------------------------- entry point
def load_study_model(cfg: ExperimentConfig, tokenizer, device: torch.device) -> tuple[Any, str]:
    """The model in float32 with the probe attention, and a description of its weights."""

    spec = cfg.analysis.rope_precision
    positions = max(spec.seq_len, *spec.lengths) + max(
        *spec.shifts, spec.delta2, spec.compare_shift
    )
    if cfg.model.path is not None and spec.random_init:
        hf = build_hf_config(cfg.model, seq_len=positions, vocab_size=len(tokenizer))
        torch.manual_seed(cfg.seed)
        with device:  # initialise in place: a 7B model inits in seconds on a GPU
            model = AutoModelForCausalLM.from_config(
                hf, dtype=torch.float32, attn_implementation=register()
            )
        weights = f"random init (architecture of {cfg.model.path}, seed {cfg.seed})"
    else:
        model = load_model(
            cfg.model,
            seq_len=positions,
            dtype="float32",
            device=device,
            attn_implementation=register(),
            tokenizer=tokenizer,
        )
        weights = f"checkpoint {cfg.model.path}" if cfg.model.path else "random init (model.tiny)"
    return prepare_model(model), weights


def run_study(
    cfg: ExperimentConfig, out_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """Run the study of ``cfg.analysis.rope_precision``; write JSON, figure and table.

    Output directory: ``out_dir`` or ``<run_dir>/analysis/``. Returns the JSON path (the PNG
    and a Markdown table lie beside it).
    """

    spec = cfg.analysis.rope_precision
    device = torch.device(resolve_device(spec.device, "analysis.rope_precision.device"))
    tokenizer = load_tokenizer(cfg.model)
    sequences, source = load_sequences(cfg, tokenizer, progress=progress)
    model, weights = load_study_model(cfg, tokenizer, device)
    result = measure(model, sequences, spec, progress=progress)
    result["settings"].update({"inputs": source, "weights": weights, "device": str(device)})
    result["config"] = cfg.model_dump(mode="json")
    return write_study(result, Path(out_dir) if out_dir is not None else cfg.run_dir / "analysis")


# ---------------------------------------------------------------------------------------- output
def write_study(result: dict[str, Any], out_dir: Path, *, figure: bool = True) -> Path:
    """Write ``rope_precision.json`` (+ manifest), the three-panel PNG and a Markdown table;
    with the per-sequence shift curves in ``result`` (what :func:`measure` returns), also
    ``rope_precision_per_sample.json`` and its figure (the paper's Figure 7).

    ``figure=False`` skips the PNGs (machines without matplotlib); render them later with
    :func:`render_figure` and :func:`render_per_sample_figure` from the JSON files.
    """

    out_dir.mkdir(parents=True, exist_ok=True)
    result = {**result, "manifest": base_manifest(command="rope-precision")}
    per_sample = result.pop(PER_SAMPLE_KEY, None)
    atomic_write_text(out_dir / MD_NAME, markdown_table(result))
    if per_sample is not None:
        samples = atomic_write_json(
            out_dir / PER_SAMPLE_JSON, per_sample_record(result, per_sample)
        )
        if figure:
            render_per_sample_figure(samples)
    path = atomic_write_json(out_dir / JSON_NAME, result)  # last: its presence means complete
    if figure:
        render_figure(path)
    return path


def per_sample_record(result: dict[str, Any], per_sample: dict[str, list]) -> dict[str, Any]:
    """The Figure 7 file: per mode, one shift curve per sequence (input order) and their mean,
    the main result's ``shift_curve`` (the same values, so equal exactly)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "study": "rope_precision_per_sample",
        "settings": result["settings"],
        PER_SAMPLE_KEY: per_sample,
        "shift_curve": result["shift_curve"],
        "manifest": result["manifest"],
    }


def render_figure(json_path: str | Path, target: str | Path | None = None) -> Path:
    """Render the three-panel PNG of a ``rope_precision.json`` (default: beside it), atomically."""
    return _render(plot_study, json_path, target, PNG_NAME)


def render_per_sample_figure(json_path: str | Path, target: str | Path | None = None) -> Path:
    """Render Figure 7 of a ``rope_precision_per_sample.json`` (default: beside it), atomically."""
    return _render(plot_per_sample, json_path, target, PER_SAMPLE_PNG)


def _render(plot, json_path: str | Path, target: str | Path | None, default_name: str) -> Path:
    json_path = Path(json_path)
    target = Path(target) if target is not None else json_path.with_name(default_name)
    png = io.BytesIO()
    plot(read_json(json_path), png)
    return atomic_write_bytes(target, png.getvalue())


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measurement (shift or length), one column per mode: for table artifacts."""
    modes = result["settings"]["modes"]
    rows = [
        {
            "quantity": f"D(Δ1={d}, Δ2={result['settings']['delta2']})",
            **{m: result["shift_curve"][m][str(d)] for m in modes},
        }
        for d in result["settings"]["shifts"]
    ]
    rows.append(
        {"quantity": "first-token share", **{m: result["first_token_share"][m] for m in modes}}
    )
    rows += [
        {
            "quantity": f"D_logit(T={n})",
            **{m: result["logit_diff_by_length"][m][str(n)] for m in modes},
        }
        for n in result["settings"]["lengths"]
    ]
    return rows


def markdown_table(result: dict[str, Any]) -> str:
    modes = result["settings"]["modes"]
    lines = [
        "# BF16 RoPE precision study",
        "",
        f"Inputs: {result['settings'].get('inputs', '?')}; weights: "
        f"{result['settings'].get('weights', '?')}; {result['settings']['num_sequences']} "
        f"sequence(s) of {result['settings']['seq_len']} tokens.",
        "",
        "| quantity | " + " | ".join(modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    lines += [
        f"| {row['quantity']} | " + " | ".join(f"{row[m]:.4g}" for m in modes) + " |"
        for row in table_rows(result)
    ]
    return "\n".join(lines) + "\n"
