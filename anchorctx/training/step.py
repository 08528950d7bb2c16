"""One optimiser step: forward/backward over the accumulation micro-batches, then update.

Loss normalisation: the objective of a step is the mean token cross-entropy over every target
of the global batch (all DP ranks, SP shards and micro-batches). Each rank back-propagates its
shard's *summed* loss divided by that global count (known to every rank in advance, see
:mod:`anchorctx.training.data`), times :func:`anchorctx.training.engine.loss_scale` to undo
DeepSpeed's own averaging. The reported loss is the all-reduced sum over the same count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from anchorctx.attention.hf import model_inputs
from anchorctx.training.data import MicroBatch, StepData
from anchorctx.training.loss import summed_cross_entropy


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float


def forward_logits(model, mb: MicroBatch, engine: str, **extra) -> torch.Tensor:
    """Logits of this rank's shard, [B, T/SP, V]. Position ids are sliced to the shard (the
    Ulysses wrapper all-gathers them); the layouts stay whole. ``extra``: more model kwargs."""
    kwargs = model_inputs(mb.layouts, engine=engine)
    kwargs["position_ids"] = kwargs["position_ids"][:, mb.shard].contiguous()
    return model(input_ids=mb.input_ids, use_cache=False, **kwargs, **extra).logits


def loss_sum(model, mb: MicroBatch, engine: str, tiled: bool = False) -> torch.Tensor:
    """This rank's summed token loss; ``tiled``: logits never whole (training.memory.tiled_loss)."""
    if tiled:
        # Imported here: tiling imports this module (forward_logits).
        from anchorctx.training.tiling import tiled_loss_sum

        return tiled_loss_sum(model, mb, engine)
    return summed_cross_entropy(forward_logits(model, mb, engine), mb.targets)


def train_step(
    engine, data: StepData, attention_engine: str, scale: float, tiled_loss: bool = False
) -> StepStats:
    """Run one optimiser step; every rank returns the same global loss and grad norm."""
    local_sum = torch.zeros((), dtype=torch.float64, device=data.micro_batches[0].input_ids.device)
    grad_norm, lr = None, engine.get_lr()[0]  # the rate this step applies
    n_targets = max(data.global_targets, 1)  # a batch without targets contributes zero
    for mb in data.micro_batches:
        mb_loss = loss_sum(engine, mb, attention_engine, tiled_loss)
        engine.backward(mb_loss * (scale / n_targets))
        if engine.is_gradient_accumulation_boundary():
            grad_norm = _unclipped_norm_if_untracked(engine)
        engine.step()
        local_sum += mb_loss.detach().double()
    dist.all_reduce(local_sum)  # every rank holds different targets: the sum is the total
    tracked = engine.get_global_grad_norm()
    grad_norm = float(tracked) if tracked is not None else grad_norm
    return StepStats(loss=float(local_sum) / n_targets, grad_norm=grad_norm, lr=lr)


def _unclipped_norm_if_untracked(engine) -> float | None:
    """ZeRO-0 in fp32 clips without recording the norm; read it from the reduced gradients
    (identical on every rank at the accumulation boundary) before the step clips them."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled():
        return None
    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
