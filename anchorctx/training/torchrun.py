"""``python -m anchorctx.training.torchrun ARGS``: torchrun (``torch.distributed.run``), with its
ways of stopping folded into one line each.

``anchorctx train`` starts this instead of ``python -m torch.distributed.run``, with the same
arguments. Stopped by a signal (Ctrl-C or SIGTERM to ``anchorctx train``, which terminates the
process group; a scheduler's SIGTERM), torchrun's agent raises ``SignalException`` out of its
``main`` and Python prints a chained traceback of some 30 lines, twice when a second signal
arrives during its shutdown, after a warning per worker. Here the agent still shuts its workers
down as it does, and then:

- a signal is one line, ``anchorctx train: torchrun stopped its workers (SIGTERM)``, exit
  128 + the signal number, and later signals are ignored (the workers are gone);
- a failed worker (its own one-line error is already printed above) is one line naming the
  first failed rank and its exit code, instead of torchrun's ``ChildFailedError`` block; the
  exit status is that rank's (2 for a config error, 1 at run time, 1 for a killed rank).

torchrun's per-worker shutdown warnings ("Received 15 death signal", "Sending process N
closing signal SIGTERM") are dropped by a logging filter; its other messages pass.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_SHUTDOWN_NOISE = ("death signal", "closing signal")
_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)


class _DropShutdownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(s in text for s in _SHUTDOWN_NOISE)


def _signal_name(sigval: object) -> str:
    try:
        return signal.Signals(int(sigval)).name  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return str(sigval)


def main(argv: list[str] | None = None) -> int:
    # Imported here: torch's launcher is needed only when this module runs.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_DropShutdownNoise())
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except SignalException as err:
        for sig in STOP_SIGNALS:  # the workers are stopped: a second signal changes nothing
            signal.signal(sig, signal.SIG_IGN)
        print(
            f"anchorctx train: torchrun stopped its workers ({_signal_name(err.sigval)})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # Skip interpreter teardown: torch's exit hooks would meet the signal state again.
        os._exit(128 + int(err.sigval))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        if code < 0:
            how = f"was killed by {_signal_name(-code)}"
        else:
            how = f"exited with status {code} (its message is above)"
        failed = len(err.failures)
        others = f"; {failed} ranks failed" if failed > 1 else ""
        print(f"anchorctx train: rank {rank} {how}{others}", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
