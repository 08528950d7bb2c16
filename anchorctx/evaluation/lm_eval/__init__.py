"""The one lm-eval adapter: every suite that runs lm-eval scores with one model class.

- :mod:`.model`: the lm-eval model ``anchorctx`` (:class:`~.model.AnchorctxLM`: the project's
  anchor rule and static decoder behind lm-eval's ``LM`` interface; ``anchorctx lm-eval``) and
  ``make_lm``, the one way the suites build it;
- :mod:`.call`: lm-eval's task manager, the call into ``simple_evaluate``, the log filter, the
  pinned version and what results record about it;
- :mod:`.harness`: MMLU and HellaSwag (suites ``mmlu``, ``hellaswag``), scored as lm-eval's
  ``hf`` model scores them;
- :mod:`.suites`: lm-eval's long-context tasks (suites ``lm_eval:<task>``).

Importing this package, :mod:`.call` or :mod:`.suites` imports neither lm-eval nor torch (the
suite registry imports them); :mod:`.model` and :mod:`.harness`'s runs do.
"""
