"""A persistent evaluation process per GPU: shards and compile-ahead passes run in it in turn.

Why: a shard in a process of its own pays the interpreter's start, the imports (torch and
transformers), CUDA's initialisation and, for every batch shape, dynamo's tracing of the decode
step and the load of its kernels from torch's on-disk cache: 17-27 s at gpu-small's evaluation
shape, as long as the shard's generation (docs/benchmarks/2026-11-27-static-decode-graphs.md). A
worker pays them once. Its compiled graphs stay in memory from request to request and from
checkpoint to checkpoint: they depend on the shapes, not on the weights
(:func:`anchorctx.models.decoder._compiled`). So a compile-ahead pass run in a worker serves the
shards that worker runs next, without the disk cache.

Each request is one run of the sharding command line (:func:`anchorctx.evaluation.sharding.main`,
the same arguments as ``python -m anchorctx.evaluation.sharding``), so a shard in a worker does
exactly what a shard process does. The worker keeps that module's per-process model cache
(:func:`~anchorctx.evaluation.results.cached_model`), one model at a time: the next suite of the
same checkpoint does not load it again.

Protocol, text lines on the worker's stdin and stdout (its stderr goes to its stdout)::

    request  {"id": "<hex>", "argv": ["--config", "CFG.json", ...]}
             {"id": "<hex>", "release": true}      (training is about to take the GPU)
    output   whatever the request prints, line by line
    reply    <RS>anchorctx-worker <id> <status> [end]
             status: as the command's exit status would be; "end": the worker exits next

- A release drops the cached model and hands the GPU memory the worker's allocator holds back
  to the device (:func:`release_memory`). What stays is what CUDA keeps per process (its
  context and loaded kernels, ~0.8 GiB on an H100;
  docs/benchmarks/2026-11-27-one-gpu-eval-worker.md), and with it the compiled decode graphs,
  cuDNN's attention graphs and the RULER samples in memory: the evaluation after the training finds
  them. The training's memory plan keeps 6% of the GPU in reserve
  (:data:`anchorctx.training.memory.RESERVED_FRACTION`), which covers it.
- A request that raises ends the worker after its reply: a failed CUDA call can leave the
  process unusable, so it is not reused. The next request starts a new worker and its log says
  so (:class:`EvalWorker`).
- The worker exits when its stdin closes or its parent dies. The parent is checked every second,
  so a flow process killed with SIGKILL leaves no worker behind.

    python -m anchorctx.evaluation.worker        # serve requests on stdin (started by EvalWorker)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from anchorctx.process import ProcessFailed, kill_group, start_server

# The reply line's prefix. RS (record separator) cannot start a line a library prints by chance.
REPLY = "\x1eanchorctx-worker"
MODULE = "anchorctx.evaluation.worker"


def _reply(request_id: str, status: int, end: bool = False) -> None:
    sys.stderr.flush()
    print(f"{REPLY} {request_id} {status}{' end' if end else ''}", flush=True)


def _status(code: object) -> int:
    """A ``SystemExit`` code as an exit status (argparse exits 2; ``sys.exit("msg")`` 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _watch_parent(parent: int, every_s: float = 1.0) -> None:
    """Exit at once when the process that started this one is gone (re-parented)."""
    while True:
        time.sleep(every_s)
        if os.getppid() != parent:
            os._exit(1)


def release_memory() -> str:
    """Drop the cached evaluation model and return the GPU memory this process' allocator
    holds to the device (training takes the GPU next); a line saying what is left."""
    from anchorctx.evaluation.results import clear_model_cache

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        clear_model_cache()
        return "evaluation worker: released (no CUDA memory held)"
    # cuBLAS keeps a workspace per handle and stream, blocks the allocator's cache cannot free
    # while they are held: dropped first, so the cache emptied below takes them too.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    clear_model_cache()  # the model, a collection, the allocator's cache
    free, total = torch.cuda.mem_get_info()
    return (
        f"evaluation worker: released; this process' allocator holds "
        f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB, the GPU has "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
    )


def _handle(request: dict) -> int:
    from anchorctx.evaluation import sharding

    if request.get("release"):
        print(release_memory(), flush=True)
        return 0
    return _status(sharding.main(list(request["argv"])))


def serve() -> int:
    """Serve requests from stdin until it closes; the worker's exit status."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            status = _handle(request)
        except SystemExit as err:  # argparse and sys.exit: a refusal, the process is sound
            status = _status(err.code)
        except BaseException:  # reported in the reply; the worker then ends
            traceback.print_exc()
            _reply(request["id"], 1, end=True)
            return 1
        _reply(request["id"], status)
    return 0


class EvalWorker:
    """The client of one worker process, on one GPU (``CUDA_VISIBLE_DEVICES``), started on its
    first request. Requests run one at a time; :meth:`close` ends the process.

    The process runs in a session of its own, as every child anchorctx starts
    (:func:`anchorctx.process.run_process_group`): a cancelled flow kills it through
    :meth:`close`, and a killed flow through the worker's own watch of its parent.
    """

    def __init__(self, gpu: str, env: Mapping[str, str] | None = None) -> None:
        self.gpu = gpu
        self._env = dict(env or {})
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.started = 0  # processes started so far (1 while the first one serves)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self, on_line: Callable[[str], None]) -> subprocess.Popen:
        again = "the last one ended; " if self.started else ""
        on_line(f"evaluation worker on GPU {self.gpu}: {again}starting one")
        env = {**self._env, "CUDA_VISIBLE_DEVICES": self.gpu}
        self._proc = start_server([sys.executable, "-m", MODULE], env=env)
        self.started += 1
        return self._proc

    def run(self, argv: Sequence[str], on_line: Callable[[str], None] | None = None) -> list[str]:
        """Run the sharding command ``argv`` in the worker; its output lines (also handed to
        ``on_line`` as they come). A non-zero status raises ``ProcessFailed`` with the tail of
        the output, as a shard process would; so does the worker's death mid-request."""
        emit = on_line or (lambda _: None)
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                proc = self._start(emit)
            return self._request(proc, {"argv": list(argv)}, [*argv], emit)

    def release(self, on_line: Callable[[str], None] | None = None) -> list[str]:
        """Have the worker free its GPU memory but its CUDA context (:func:`release_memory`),
        waiting for a request it runs to end first; its output lines. No worker: nothing."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return []
            return self._request(
                proc, {"release": True}, ["--release"], on_line or (lambda _: None)
            )

    def _request(
        self, proc: subprocess.Popen, request: dict, args: list[str], emit: Callable[[str], None]
    ) -> list[str]:
        """Send ``request`` (``args``: how errors name it) and read its reply; the lock held."""
        request_id = secrets.token_hex(8)
        cmd = [sys.executable, "-m", MODULE, *args]  # how ProcessFailed names the request
        try:
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps({"id": request_id, **request}) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died since the last request: its output says why
                pass
            lines, status, ends = self._read_reply(proc, request_id, emit)
        except BaseException:
            self._kill()  # cancelled or broken mid-request: the worker's state is unknown
            raise
        if ends:  # it exits after this reply: the next request must start another
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            self._kill()
        if status is None:  # the worker died: its output ended without a reply (ended above)
            code = proc.wait()
            raise ProcessFailed(cmd, code if code else 1, lines)
        if status != 0:
            raise ProcessFailed(cmd, status, lines)
        return lines

    @staticmethod
    def _read_reply(
        proc: subprocess.Popen, request_id: str, emit: Callable[[str], None]
    ) -> tuple[list[str], int | None, bool]:
        """The request's output lines, its status (None when the output ended first) and
        whether the worker exits after it."""
        lines: list[str] = []
        for raw in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]  # started with stdout=PIPE
            line = raw.rstrip("\n")
            if line.startswith(f"{REPLY} {request_id} "):
                status, *end = line[len(REPLY) :].split()[1:]
                return lines, int(status), end == ["end"]
            lines.append(line)
            emit(line)
        return lines, None, True

    def _kill(self) -> None:
        if self._proc is not None:
            kill_group(self._proc, grace_s=5.0)
            self._proc = None

    def close(self) -> None:
        """End the worker; its GPU memory is freed and the next request starts a new one. An
        idle worker ends at the close of its stdin; one running a request is killed with its
        process group, and the request raises ``ProcessFailed`` (a cancelled flow)."""
        proc = self._proc
        if proc is None:
            return
        if not self._lock.acquire(blocking=False):
            kill_group(proc, grace_s=5.0)
            return
        try:
            if proc.stdin is not None:
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    proc.stdin.close()  # the worker's loop ends at EOF
                    proc.wait(timeout=10)
            self._kill()
        finally:
            self._lock.release()


if __name__ == "__main__":
    raise SystemExit(serve())
