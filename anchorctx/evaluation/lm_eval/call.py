"""The project's one way into lm-eval: the model it scores with, the call, its logs, its version.

Every suite that runs lm-eval (MMLU and HellaSwag in :mod:`.harness`, the ``lm_eval:<task>``
suites in :mod:`.suites`) builds its model with :func:`~.model.make_lm` (the lm-eval model
``anchorctx``, :class:`~.model.AnchorctxLM`, around the already loaded checkpoint), indexes its
task YAMLs with :func:`task_manager` and runs them through :func:`evaluate`
(``simple_evaluate``), with lm-eval's logs through :func:`quiet`; results record
:func:`reference`.

``simple_evaluate`` ends every call by adding torch's environment report to its result
(``lm_eval.loggers.utils.add_env_info`` calls ``torch.utils.collect_env.get_pretty_env_info``,
which runs ``python -m pip list``, the compilers' and ``nvidia-smi``'s version commands: 1.8 s
measured on a 2-core machine). The report cannot change within a process and the project reads
none of it, yet MMLU calls ``simple_evaluate`` once per subject (57 calls per checkpoint: about
100 s of ``pip list``) and every RULER/BABILong unit of an ``lm_eval:`` suite once per length.
So the report is made once per process and reused: the same string, so lm-eval's result is
unchanged. Nothing of lm-eval or torch is edited; the module attribute lm-eval reads at each
call is wrapped in a cache.

Nothing here imports lm-eval or torch at module import (the suite registry imports the suites).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
from pathlib import Path
from typing import Any

# The lm-eval release whose task files, prompts and metrics are the reference (the lock file
# pins it); results record the installed version next to it.
LM_EVAL_VERSION = "0.4.13"
MODEL_NAME = "anchorctx"  # the lm-eval model every suite scores with

# lm-eval warnings that describe exactly what the suites ask for, on every task: an explicit
# num_fewshot (every MMLU subject, HellaSwag) and a ``custom_dataset`` whose kwargs the suite
# passes itself (the local-file loaders of the long-context tasks). (logger, message part) pairs.
EXPECTED_WARNINGS = (
    ("lm_eval.evaluator", "Overwriting default num_fewshot of "),
    ("lm_eval.api.task", "Custom kwargs can be passed"),
)


class LmEvalDataError(ValueError):
    """An lm-eval suite cannot run on its inputs (a data file missing or malformed, lm-eval not
    installed or without the task); the message names the file or what to install."""


class _DropExpected(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(part in message for part in self.parts)


def quiet() -> None:
    """lm-eval's logs at WARNING (it logs every task build and request batch at INFO; the suites
    report per unit), less :data:`EXPECTED_WARNINGS`. Idempotent."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # A logger's filters see only records created on that logger, so each gets its own.
    for name in dict.fromkeys(n for n, _ in EXPECTED_WARNINGS):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(tuple(m for n, m in EXPECTED_WARNINGS if n == name)))


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        return None


def reference(tokenizer: Any = None, **fields: Any) -> dict[str, Any]:
    """What a result records about lm-eval: the installed and pinned versions, the model, the
    anchor token (when ``tokenizer`` is given) and the suite's own ``fields``."""
    out: dict[str, Any] = {
        "lm_eval": installed_version(),
        "pinned": LM_EVAL_VERSION,
        "model": MODEL_NAME,
        **fields,
    }
    if tokenizer is not None:
        # Imported here: the anchor rule lives with model loading, which imports transformers.
        from anchorctx.models.loading import anchor_token_id

        out["anchor_token_id"] = anchor_token_id(tokenizer)
    return out


def tasks_dir() -> Path:
    """lm-eval's ``tasks`` directory, found without importing lm-eval (it imports torch)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise LmEvalDataError("lm-eval is not installed (pip install lm-eval)")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def task_manager(task_dir: Path, metadata: dict[str, Any] | None = None) -> Any:
    """lm-eval's ``TaskManager`` over the task YAMLs written into ``task_dir``."""
    # Imported here: lm-eval imports torch and transformers.
    from lm_eval.tasks import TaskManager

    # include_defaults=False: index only these YAMLs (indexing all of lm-eval takes seconds);
    # their ``include`` lines still reach lm-eval's own files by absolute path.
    return TaskManager(include_path=str(task_dir), include_defaults=False, metadata=metadata)


def environment_report_once() -> None:
    """Cache ``torch.utils.collect_env.get_pretty_env_info`` for this process (idempotent)."""
    import torch.utils.collect_env as collect_env

    report = collect_env.get_pretty_env_info
    if not hasattr(report, "cache_info"):
        collect_env.get_pretty_env_info = functools.cache(report)


def simple_evaluate(**kwargs: Any) -> dict[str, Any] | None:
    """``lm_eval.evaluator.simple_evaluate(**kwargs)`` with the environment report made once
    per process (module docstring)."""
    # Imported here: lm-eval imports torch and transformers, which config loading never needs.
    from lm_eval import evaluator

    environment_report_once()
    return evaluator.simple_evaluate(**kwargs)


def evaluate(lm: Any, manager: Any, task: str, **kwargs: Any) -> dict[str, Any]:
    """``simple_evaluate``'s output for one ``task`` of ``manager`` on ``lm``, with its
    per-document samples (``kwargs``: num_fewshot, limit or samples)."""
    out = simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )
    if out is None or task not in out.get("samples", {}):
        raise RuntimeError(f"lm-eval returned no samples for task {task!r}")
    return out
