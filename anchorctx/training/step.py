"""One optimiser step: forward/backward over the accumulation micro-batches, then update.

Loss normalisation: the objective of a step is the mean token cross-entropy over every target
of the global batch (all DP ranks, SP shards and micro-batches). Each rank back-propagates its
shard's *summed* loss divided by that global count (known to every rank in advance, see
:mod:`anchorctx.training.data`), times :func:`anchorctx.training.engine.loss_scale` to undo
DeepSpeed's own averaging. The reported loss is the all-reduced sum over the same count.

The summed loss of a micro-batch is one of two functions of one signature (:class:`LossFn`),
chosen once per run by :func:`loss_function` (``training.memory.tiled_loss``): the plain
cross-entropy of the whole logits, or the tiled one whose ``[B, T/SP, V]`` logits never exist
whole (:mod:`anchorctx.training.tiling`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from anchorctx.attention.hf import model_inputs
from anchorctx.training import tiling
from anchorctx.training.data import MicroBatch, StepData
from anchorctx.training.loss import summed_cross_entropy, tiled_summed_cross_entropy

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float


class LossFn(Protocol):
    """This rank's summed token loss of a micro-batch, an fp32 scalar. ``model``: the DeepSpeed
    engine in training (its forward runs ZeRO-3's gather hooks), or a bare model."""

    def __call__(
        self, model: DeepSpeedEngine | torch.nn.Module, mb: MicroBatch, attention_engine: str
    ) -> torch.Tensor: ...


def forward_logits(
    model: DeepSpeedEngine | torch.nn.Module, mb: MicroBatch, attention_engine: str, **extra
) -> torch.Tensor:
    """Logits of this rank's shard, [B, T/SP, V]. Position ids are sliced to the shard (the
    Ulysses wrapper all-gathers them); the layouts stay whole. ``extra``: more model kwargs."""
    kwargs = model_inputs(mb.layouts, engine=attention_engine)
    kwargs["position_ids"] = kwargs["position_ids"][:, mb.shard].contiguous()
    return model(input_ids=mb.input_ids, use_cache=False, **kwargs, **extra).logits


def plain_loss_sum(
    model: DeepSpeedEngine | torch.nn.Module, mb: MicroBatch, attention_engine: str
) -> torch.Tensor:
    """This rank's summed token loss from its whole ``[B, T/SP, V]`` logits."""
    return summed_cross_entropy(forward_logits(model, mb, attention_engine), mb.targets)


def tiled_loss_sum(
    model: DeepSpeedEngine | torch.nn.Module, mb: MicroBatch, attention_engine: str
) -> torch.Tensor:
    """This rank's summed token loss without materialising its ``[B, T/SP, V]`` logits.

    The forward goes through ``model`` (under DeepSpeed, ZeRO-3's start/end-of-forward hooks
    run as usual) with ``logits_to_keep`` empty, so the model's own LM head sees zero positions;
    the final hidden states are taken from the decoder's norm and the head runs tile by tile.
    """
    module = _hf_model(model)
    none = torch.empty(0, dtype=torch.long, device=mb.input_ids.device)
    with _final_hidden(module) as captured:
        forward_logits(model, mb, attention_engine, logits_to_keep=none)
    hidden = captured["hidden"]  # [B, T/SP, H]
    head = module.get_output_embeddings()
    vocab = module.config.get_text_config().vocab_size  # ZeRO-3 partitions head.weight itself
    # Read from the module at call time, so the tile size can be substituted (tests do).
    tiles = tiling.agreed_tiles(tiling.loss_tiles(hidden.shape[1], vocab), hidden.device)
    return tiled_summed_cross_entropy(head, hidden, mb.targets, tiles)


def _hf_model(model: DeepSpeedEngine | torch.nn.Module) -> PreTrainedModel:
    """The transformers model: the one DeepSpeed wraps (its ``module``), or ``model`` itself."""
    module = getattr(model, "module", model)
    if not isinstance(module, PreTrainedModel):
        raise TypeError(f"{type(module).__name__} is not a transformers model (PreTrainedModel)")
    return module


@contextmanager
def _final_hidden(model: PreTrainedModel) -> Iterator[dict[str, torch.Tensor]]:
    """Captures the decoder's final (normed) hidden states, [B, T, H], during a forward."""
    out: dict[str, torch.Tensor] = {}
    norm = model.get_decoder().norm
    handle = norm.register_forward_hook(lambda _m, _i, o: out.__setitem__("hidden", o))
    try:
        yield out
    finally:
        handle.remove()


def loss_function(tiled: bool) -> LossFn:
    """The run's loss of a micro-batch: tiled with ``training.memory.tiled_loss``."""
    return tiled_loss_sum if tiled else plain_loss_sum


def loss_sum(
    model: DeepSpeedEngine | torch.nn.Module,
    mb: MicroBatch,
    attention_engine: str,
    tiled: bool = False,
) -> torch.Tensor:
    """This rank's summed token loss; ``tiled``: logits never whole (training.memory.tiled_loss)."""
    return loss_function(tiled)(model, mb, attention_engine)


def train_step(
    ds_engine: DeepSpeedEngine,
    data: StepData,
    attention_engine: str,
    scale: float,
    loss_fn: LossFn = plain_loss_sum,
) -> StepStats:
    """Run one optimiser step; every rank returns the same global loss and grad norm.
    ``loss_fn``: the run's :func:`loss_function`."""
    local_sum = torch.zeros((), dtype=torch.float64, device=data.micro_batches[0].input_ids.device)
    grad_norm, lr = None, ds_engine.get_lr()[0]  # the rate this step applies
    n_targets = max(data.global_targets, 1)  # a batch without targets contributes zero
    for mb in data.micro_batches:
        mb_loss = loss_fn(ds_engine, mb, attention_engine)
        ds_engine.backward(mb_loss * (scale / n_targets))
        if ds_engine.is_gradient_accumulation_boundary():
            grad_norm = _unclipped_norm_if_untracked(ds_engine)
        ds_engine.step()
        local_sum += mb_loss.detach().double()
    dist.all_reduce(local_sum)  # every rank holds different targets: the sum is the total
    tracked = ds_engine.get_global_grad_norm()
    grad_norm = float(tracked) if tracked is not None else grad_norm
    return StepStats(loss=float(local_sum) / n_targets, grad_norm=grad_norm, lr=lr)


def _unclipped_norm_if_untracked(ds_engine: DeepSpeedEngine) -> float | None:
    """ZeRO-0 in fp32 clips without recording the norm; read it from the reduced gradients
    (identical on every rank at the accumulation boundary) before the step clips them."""
    if ds_engine.zero_optimization_stage() != 0 or ds_engine.bfloat16_enabled():
        return None
    grads = [p.grad.detach().float() for p in ds_engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
