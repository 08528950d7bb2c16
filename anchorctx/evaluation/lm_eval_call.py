"""The project's one call into lm-eval's ``simple_evaluate`` (MMLU and HellaSwag in
:mod:`~anchorctx.evaluation.harness`, the ``lm_eval:<task>`` suites in
:mod:`~anchorctx.evaluation.lm_eval_suites`).

``simple_evaluate`` ends every call by adding torch's environment report to its result
(``lm_eval.loggers.utils.add_env_info`` calls ``torch.utils.collect_env.get_pretty_env_info``,
which runs ``python -m pip list``, the compilers' and ``nvidia-smi``'s version commands: 1.8 s
measured on a 2-core machine). The report cannot change within a process and the project reads
none of it, yet MMLU calls ``simple_evaluate`` once per subject (57 calls per checkpoint: about
100 s of ``pip list``) and every RULER/BABILong unit of an ``lm_eval:`` suite once per length.
So the report is made once per process and reused: the same string, so lm-eval's result is
unchanged. Nothing of lm-eval or torch is edited; the module attribute lm-eval reads at each
call is wrapped in a cache.
"""

from __future__ import annotations

import functools
from typing import Any


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
