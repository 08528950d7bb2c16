"""How an error reaches the user: one line and an exit status. Shared by the ``anchorctx``
command and the training ranks it launches (``training/worker.py``), which must not import the
command line's every command (and their packages: a GPU host that only trains lacks the
evaluation suites' dependencies)."""

from __future__ import annotations

# Exception class names that mean "the command or config is wrong" (exit 2), wherever defined.
USAGE_ERRORS = frozenset({"ConfigError", "UsageError"})


def exit_code(err: BaseException) -> int:
    """2 for usage/config errors (the exception or its class says so), 1 for everything else."""
    code = getattr(err, "exit_code", None)
    if isinstance(code, int):
        return code
    return 2 if any(c.__name__ in USAGE_ERRORS for c in type(err).__mro__) else 1


def error_line(err: BaseException) -> str:
    """One line describing ``err``: our own errors already say what to fix; anything else gets
    its type (and, for OS errors, the file) so the cause is recognisable."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        text = f"{err.strerror}{where}"
        if err.filename2:
            text += f" -> {err.filename2}"
    else:
        text = str(err)
        own = type(err).__module__.startswith("anchorctx")
        if not own or not text:
            text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return " ".join(text.split())
