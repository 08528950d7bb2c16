"""Training: DeepSpeed ZeRO + Ulysses sequence parallelism with the anchorctx attention, the
step loop, loss, checkpoints, metrics and the launcher.

``anchorctx.training.loop.train(cfg, resume=False)`` runs in this process (one rank);
``anchorctx.training.launch.launch(cfg, resume=False, force=False)`` is what ``anchorctx train``
calls: in-process for one process, torchrun/DeepSpeed for more. Both hold the run directory's
writer lock and refuse to restart an existing run silently (``resume`` continues it; ``force``
moves it aside first). Model and tokenizer loading live in :mod:`anchorctx.models`.
"""
