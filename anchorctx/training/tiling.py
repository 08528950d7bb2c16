"""Long-row memory: the model-side options of ``training.memory`` (DeepSpeed's ALST pieces) and
the tile counts of the tiled pieces.

Arctic Long Sequence Training (ALST, DeepSpeed's ``ulysses_sp`` module, which the project already
uses for Ulysses) removes the three activations that grow as ``T × something wide``:

- **Tiled MLP** (``training.memory.tiled_mlp``): each decoder MLP runs in sequence tiles through
  DeepSpeed's ``TiledMLP`` autograd function, so the ``[T, intermediate]`` gate/up/product
  tensors exist one tile at a time. The MLP forward is recomputed per tile in backward. The MLP
  module's ``forward`` is replaced *on the instance* (the class and the transformers source are
  untouched, parameter names do not change).
- **Tiled logits + loss** (``training.memory.tiled_loss``): the LM head and the project's
  :func:`~anchorctx.training.loss.summed_cross_entropy` run per tile through DeepSpeed's
  ``sequence_tiled_compute``, so ``T × vocab`` logits never exist whole. That function (unlike
  ``TiledFusedLogitsLoss``, which back-propagates inside its forward with an assumed incoming
  gradient of 1) recomputes each tile in backward with the real incoming gradient, so the LM-head
  weight gradient is right under the step's ``scale / global_targets`` factor. A loss, not a
  model change: :func:`anchorctx.training.step.tiled_loss_sum` (chosen once per run by
  :func:`anchorctx.training.step.loss_function`) with its tile count from here.
- **Checkpoint offload** (``training.memory.offload_checkpoints``): the decoder layers are
  checkpointed by DeepSpeed's activation checkpointing with ``cpu_checkpointing``, which keeps
  each layer's input (one ``[T, hidden]`` tensor per layer) in CPU memory until backward.

Optimizer offload is a DeepSpeed config entry
(:func:`anchorctx.training.deepspeed_env.offload_entries`).

Tile counts. Under ZeRO-3 every tile's call gathers the module's weights with a collective, so
every rank must run the same number of tiles: the count is all-reduced (max) over the process
group, as ALST does. MLP tiles: ``ceil(T / hidden)`` (ALST's rule: a tile's ``[tile,
intermediate]`` activations are then no larger than one MLP weight). Loss tiles: as many as keep
one tile's fp32 logits within :data:`LOSS_TILE_BYTES`.
"""

from __future__ import annotations

import math
import types
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from anchorctx.training.deepspeed_env import import_deepspeed
from anchorctx.training.plan import TrainingError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from anchorctx.experiment import ExperimentConfig
    from anchorctx.training.settings import MemoryConfig

# fp32 logits of one loss tile (the cross-entropy upcasts them): 1 GiB keeps the tile's logits,
# log-softmax and logit gradient (≈ 3 GiB in all) small beside a long row's activations while
# each tile's LM-head matmul stays large enough (≥ 8K tokens at a 32K vocabulary) to run at speed.
LOSS_TILE_BYTES = 1 << 30


def agreed_tiles(n: int, device: torch.device) -> int:
    """``n`` made equal on every rank (the maximum): ZeRO-3 gathers weights once per tile."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(n, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t.item())
    return n


def mlp_tiles(seq_len: int, hidden: int) -> int:
    return max(1, math.ceil(seq_len / hidden))


def loss_tiles(seq_len: int, vocab: int) -> int:
    return max(1, math.ceil(seq_len * vocab * 4 / LOSS_TILE_BYTES))


def decoder_layers(model) -> list:
    """The decoder blocks of a Hugging Face causal LM (``model.model.layers`` for Llama,
    Mistral, Qwen2)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder .layers to tile")
    return list(layers)


def _tiled_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # Imported here: DeepSpeed loads only through import_deepspeed() (its op cache set first).
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    # x: [B, T, hidden] (or [T, hidden]); TiledMLP chunks along the sequence dim (-2).
    tiles = agreed_tiles(mlp_tiles(x.shape[-2], x.shape[-1]), x.device)
    return TiledMLP.apply(_untiled_mlp, self, x, tiles, list(self.parameters()))


def _untiled_mlp(module, x: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, x)  # the class's own forward (the instance's is tiled)


def enable_tiled_mlp(model) -> int:
    """Run every decoder layer's MLP through DeepSpeed's TiledMLP; returns the layers wrapped."""
    import_deepspeed()
    layers = decoder_layers(model)
    for layer in layers:
        layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
    return len(layers)


def enable_checkpoint_offload(model) -> int:
    """Checkpoint the decoder layers with DeepSpeed's activation checkpointing, their inputs kept
    in CPU memory; returns the layers switched. Needs gradient checkpointing enabled first."""
    deepspeed = import_deepspeed()
    # transformers marks a checkpointed block with ``gradient_checkpointing = True`` and calls
    # its ``_gradient_checkpointing_func(forward_with_kwargs, *tensors)``.
    layers = [x for x in decoder_layers(model) if getattr(x, "gradient_checkpointing", False)]
    if not layers:
        raise ValueError(
            "training.memory.offload_checkpoints needs training.activation_checkpointing=true"
        )
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    for layer in layers:
        layer._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
    return len(layers)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward (non-reentrant checkpointing).

    transformers renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``
    (the old name warns from 5.2x on and goes in 6); the GPU image's 5.17 has only the old one,
    so the name is chosen by what the model has, not by catching the warning.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_memory_options(model, memory: MemoryConfig) -> None:
    """The model-side options of ``training.memory`` (call after gradient checkpointing is on,
    before ``deepspeed.initialize``)."""
    if memory.tiled_mlp:
        enable_tiled_mlp(model)
    if memory.offload_checkpoints:
        enable_checkpoint_offload(model)
    if memory.keep_activations:
        keep_activations(model, memory.keep_activations)


def keep_activations(model, count: int) -> None:
    """Turn activation checkpointing off for the last ``count`` decoder layers: they keep their
    forward activations for backward (transformers checkpoints per layer, by each layer's
    ``gradient_checkpointing`` flag). The last layers are the first that backward reaches, so
    their activations are also the first freed."""
    layers = decoder_layers(model)
    if count > len(layers):
        raise TrainingError(
            f"training.memory.keep_activations={count} exceeds the model's "
            f"{len(layers)} decoder layers"
        )
    for layer in layers[len(layers) - count :]:
        layer.gradient_checkpointing = False


def init_context(cfg: ExperimentConfig, device: str | torch.device):
    """Where a new ``model.tiny`` model's tensors are created: on ``device`` with
    ``training.memory.init_on_device`` (random init runs there; no full CPU copy is built and
    moved), else the default (CPU). Models loaded from ``model.path`` are left as they load."""
    on_device = cfg.training.memory.init_on_device and cfg.model.tiny is not None
    return torch.device(device) if on_device else nullcontext()
