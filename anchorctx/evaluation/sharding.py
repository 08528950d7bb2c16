"""One (checkpoint, suite) evaluation split over several processes, one per GPU.

The unit of work is the group inside which a suite batches its samples: RULER's
(task, length), an lm-eval suite's lm-eval task (and length, for RULER and BABILong,
:func:`anchorctx.evaluation.lm_eval.suites.units`); every other suite is one unit. A shard owns whole units, so each sample is
generated in the same batch as without sharding (on identical GPUs) and its record, hence every
score, does not depend on the sharding.

Files (next to the suite's samples file, see :mod:`anchorctx.evaluation.results`; under
``run_root`` for a checkpoint outside it)::

    <suite>.samples.shard-<i>-of-<n>.jsonl   one shard's records (same header as the samples file)

A shard resumes from the samples file and from every shard file of the same identity (so a
re-run with another number of GPUs loses nothing). :func:`finalize` folds them into the samples
file, sorted by key, deletes the shard files and runs the ordinary
:func:`~anchorctx.evaluation.results.evaluate_checkpoint`, which then finds every sample done
and writes ``<suite>.json``; re-running it is the usual cached no-op.

    python -m anchorctx.evaluation.sharding --config CFG.json --checkpoint DIR --suite ruler \
        --shard 0 2 --units niah_single_1/4096 qa_1/131072      # one shard (one GPU)
    python -m anchorctx.evaluation.sharding --config CFG.json --checkpoint DIR --suite ruler \
        --finalize                                               # merge and write the result
    python -m anchorctx.evaluation.sharding --config CFG.json --checkpoint BASE --suite ruler \
        --shard 0 2 --units niah_single_1/4096 --compile-only    # compile ahead (compile_shard)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from anchorctx.evaluation.lm_eval import suites as lm_eval_suites
from anchorctx.evaluation.results import (
    HEADER_KEY,
    cached_model,
    check_checkpoint,
    check_inputs,
    check_unchanged,
    evaluate_checkpoint,
    get_suite,
    identity,
    load_done,
    load_result,
    log_time,
    repair_torn_tail,
    result_matches,
    result_path,
    samples_path,
    start_samples,
    suite_stem,
    time_log_path,
    trust_checkpoint_hash,
)
from anchorctx.evaluation.ruler.constants import task_spec
from anchorctx.evaluation.ruler.runner import data_paths, plan_samples, selected_tasks
from anchorctx.evaluation.settings import LM_EVAL_PREFIX
from anchorctx.experiment import ExperimentConfig
from anchorctx.io import append_jsonl, atomic_write_text, read_jsonl

WHOLE = "*"  # the unit of a suite that is not split


# Seconds per sample of the static engine on one H200, Llama-2-7B shape
# (docs/benchmarks/2026-11-23-eval-generation-static-engine.md), fitted over 4K-128K with L in
# thousands of tokens: prefill ≈ a·L + b·L² (0.116 s at 4K, 1.35 s at 32K, 11.6 s at 128K; the fit
# is within 4% of each), and one decode step per sample, at the batch rows the memory rule picks, ≈
# c + d·L (0.94 ms at 4K, 5.5 ms at 32K, 21.6 ms at 128K; within 16%). Only ratios matter for
# balancing, so other models and GPUs share the fit.
PREFILL_S_PER_KTOKEN = 0.027
PREFILL_S_PER_KTOKEN2 = 4.96e-4
DECODE_S_PER_TOKEN = 3e-4
DECODE_S_PER_TOKEN_KTOKEN = 1.66e-4


def sample_cost(length: int, new_tokens: int) -> float:
    """Estimated seconds of one sample: prefill of ``length`` tokens, then ``new_tokens`` steps."""
    k = length / 1024
    prefill = PREFILL_S_PER_KTOKEN * k + PREFILL_S_PER_KTOKEN2 * k * k
    return prefill + new_tokens * (DECODE_S_PER_TOKEN + DECODE_S_PER_TOKEN_KTOKEN * k)


def units(cfg: ExperimentConfig, suite: str) -> dict[str, float]:
    """The suite's work units and their estimated cost (seconds, by :func:`sample_cost`; an
    lm-eval suite's: relative, by its lengths)."""
    if is_lm_eval(suite):
        return {u.key: lm_eval_suites.unit_cost(u) for u in lm_eval_suites.units(cfg, suite)}
    if suite != "ruler":
        return {WHOLE: 1.0}

    r = cfg.evaluation.ruler
    # Every unit has num_samples samples (QA tasks may have fewer when their question file is
    # short; the estimate ignores that, as reading the file would cost each planner its parse).
    return {
        f"{task}/{length}": r.num_samples * sample_cost(length, task_spec(task).max_new_tokens)
        for task in selected_tasks(r.tasks, r.exclude)
        for length in r.lengths
    }


def unit_of(suite: str, key: str) -> str:
    """The unit a record key belongs to (RULER keys are ``task/length/index``; an lm-eval
    suite has one record per unit, keyed by it)."""
    if is_lm_eval(suite):
        return key
    return key.rsplit("/", 1)[0] if suite == "ruler" else WHOLE


def is_lm_eval(suite: str) -> bool:
    return suite.startswith(LM_EVAL_PREFIX)


def plan_shards(cfg: ExperimentConfig, suite: str, count: int) -> list[list[str]]:
    """Units split into at most ``count`` shards of about equal cost (longest processing time
    first; deterministic: ties go to the lower shard and the lexically first unit)."""
    cost = units(cfg, suite)
    shards: list[list[str]] = [[] for _ in range(max(1, min(count, len(cost))))]
    load = [0.0] * len(shards)
    for unit in sorted(cost, key=lambda u: (-cost[u], u)):
        i = min(range(len(shards)), key=lambda k: (load[k], k))
        shards[i].append(unit)
        load[i] += cost[unit]
    return shards


def shard_path(
    checkpoint: str | Path, suite: str, index: int, count: int, cfg: ExperimentConfig | None = None
) -> Path:
    main = samples_path(checkpoint, suite, cfg)
    return main.with_name(f"{suite_stem(suite)}.samples.shard-{index}-of-{count}.jsonl")


def _shard_files(
    checkpoint: str | Path, suite: str, cfg: ExperimentConfig | None = None
) -> list[Path]:
    main = samples_path(checkpoint, suite, cfg)
    return sorted(main.parent.glob(f"{suite_stem(suite)}.samples.shard-*.jsonl"))


def _records(cfg: ExperimentConfig, checkpoint: Path, suite: str) -> dict[str, dict[str, Any]]:
    """Records of this identity from the samples file and every shard file."""
    ident = identity(cfg, checkpoint, suite)
    done: dict[str, dict[str, Any]] = {}
    for path in [samples_path(checkpoint, suite, cfg), *_shard_files(checkpoint, suite, cfg)]:
        done.update(load_done(path, ident) or {})
    return done


def prepare(cfg: ExperimentConfig, checkpoint: str | Path, suite: str, force: bool) -> bool:
    """Before shards start: False when an up-to-date result exists (nothing to do). Otherwise a
    samples file of another identity (or, with ``force``, any) is restarted and its shard files
    and result deleted, so that shards starting together never race to reset it."""
    ckpt = check_checkpoint(checkpoint)
    ident = identity(cfg, ckpt, suite)
    samples = samples_path(ckpt, suite, cfg)
    if not force and result_matches(load_result(result_path(ckpt, suite, cfg)), ident, samples):
        return False
    repair_torn_tail(samples)
    if force or load_done(samples, ident) is None:
        samples.parent.mkdir(parents=True, exist_ok=True)
        start_samples(samples, ident)
        for path in _shard_files(ckpt, suite, cfg):
            path.unlink()
        result_path(ckpt, suite, cfg).unlink(missing_ok=True)
        time_log_path(samples).unlink(missing_ok=True)
    return True


class _OwnedOnly(Mapping):
    """``done`` as the shard's runner sees it: records of other shards' units count as done,
    so the runner skips them. Iteration and lookup give only real records (RULER builds its
    summary from those; the shard's summary is discarded anyway)."""

    def __init__(self, done: dict[str, dict[str, Any]], suite: str, owned: set[str]):
        self._done, self._suite, self._owned = done, suite, owned

    def __contains__(self, key: object) -> bool:
        return key in self._done or unit_of(self._suite, str(key)) not in self._owned

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._done)

    def __len__(self) -> int:
        return len(self._done)


def _owned_view(
    done: dict[str, dict[str, Any]], suite: str, owned: list[str]
) -> Mapping[str, dict[str, Any]]:
    """``done`` as a shard owning ``owned`` units hands it to the suite's runner."""
    if owned == [WHOLE] or (suite != "ruler" and not is_lm_eval(suite)):
        return done
    return _OwnedOnly(done, suite, set(owned))


def run_shard(
    cfg: ExperimentConfig,
    checkpoint: str | Path,
    suite: str,
    owned: list[str],
    index: int,
    count: int,
    *,
    progress: bool = False,
    timing: dict[str, float] | None = None,
) -> Path:
    """Generate the records of ``owned`` units not recorded yet; returns the shard file.
    ``timing`` receives the seconds of its phases (setup, model load, generation)."""
    start = time.perf_counter()

    spec = get_suite(suite)
    ckpt = check_checkpoint(checkpoint)
    check_inputs(cfg, suite)
    ident = identity(cfg, ckpt, suite)
    out = shard_path(ckpt, suite, index, count, cfg)
    repair_torn_tail(out)  # a shard killed mid-append: the next record gets a line of its own
    if not out.is_file() or (read_jsonl(out)[:1] or [{}])[0].get(HEADER_KEY) != ident:
        start_samples(out, ident)
    view = _owned_view(_records(cfg, ckpt, suite), suite, owned)
    loading = time.perf_counter()
    model, tokenizer = cached_model(ckpt, cfg, ident["checkpoint_hash"])
    generating = time.perf_counter()
    written = 0

    def on_sample(record: dict[str, Any]) -> None:
        nonlocal written
        append_jsonl(out, record)
        written += 1

    extra = {"checkpoint": ckpt} if spec.takes_checkpoint else {}
    spec.runner(model, tokenizer, cfg, done=view, on_sample=on_sample, progress=progress, **extra)
    # Inputs rewritten meanwhile: fail. The file keeps the old identity, so a rerun starts over.
    check_unchanged(cfg, suite, ident)
    seconds = {
        "setup_s": loading - start,
        "load_s": generating - loading,
        "generate_s": time.perf_counter() - generating,
    }
    log_time(
        samples_path(ckpt, suite, cfg),
        ident,
        f"shard {index} of {count}",
        seconds | {"records": written},
    )
    if timing is not None:
        timing.update(seconds)
    return out


def _as_trained(model: Any, cfg: ExperimentConfig) -> None:
    """Give a base model the position limit the evaluated arm's training gives it
    (:func:`~anchorctx.models.loading.position_limit`): the suites check their lengths against
    it, and gpu-small's base model, pretrained at 2K (limit 4096), refused the arms' RULER at 8K
    and 16K, so its compile-ahead pass failed on a GPU host. The compiled graphs depend on the
    shapes only, so the limit changes nothing else."""
    from anchorctx.models.loading import position_limit

    limit = position_limit(cfg.model, cfg.data.seq_len)
    if limit is not None and limit > getattr(model.config, "max_position_embeddings", 0):
        model.config.max_position_embeddings = int(limit)


def compile_shard(
    cfg: ExperimentConfig,
    checkpoint: str | Path,
    suite: str,
    owned: list[str],
    *,
    timing: dict[str, float] | None = None,
) -> int:
    """Run the shard of ``owned`` units compile-only (:func:`~anchorctx.evaluation.generation.
    compile_only`): the same samples and batches as :func:`run_shard` from nothing, so its
    process compiles the graphs that shard will decode with (kept in memory when it runs in an
    evaluation worker, which then runs that shard, and in torch's on-disk caches for any other
    process) and builds the samples and the prefill attention's kernel plans; nothing is
    generated or written. ``checkpoint``: the evaluated model or any of its
    architecture and dtype (the arms' base model, before they are trained: the compiled
    graphs depend on shapes, not weights; same depth, so the memory-sized batches are the
    same). Returns the number of samples planned; ``timing`` receives the phases' seconds."""
    start = time.perf_counter()
    spec = get_suite(suite)
    if not spec.decodes:
        raise ValueError(f"suite {suite!r} does not decode through the static engine alone")
    ckpt = check_checkpoint(checkpoint)
    check_inputs(cfg, suite)
    view = _owned_view({}, suite, owned)  # from nothing, as the shard's first run
    loading = time.perf_counter()
    # Imported here, inside the load phase as in run_shard (where the model's loading imports
    # torch and transformers): the flow processes that plan shards never import them.
    from anchorctx.evaluation.generation import compile_only

    # The key only scopes the process' model cache: this process evaluates nothing.
    model, tokenizer = cached_model(ckpt, cfg, "compile-only")
    _as_trained(model, cfg)
    compiling = time.perf_counter()
    planned = 0

    def on_sample(record: dict[str, Any]) -> None:
        nonlocal planned
        planned += 1

    with compile_only():
        spec.runner(model, tokenizer, cfg, done=view, on_sample=on_sample, progress=False)
    if timing is not None:
        timing.update(
            setup_s=loading - start,
            load_s=compiling - loading,
            compile_s=time.perf_counter() - compiling,
        )
    return planned


def merge_shards(cfg: ExperimentConfig, checkpoint: str | Path, suite: str) -> int:
    """Fold the shard files into the samples file (records sorted by key); returns the count."""
    ckpt = check_checkpoint(checkpoint)
    ident = identity(cfg, ckpt, suite)
    done = _records(cfg, ckpt, suite)
    lines = [json.dumps({HEADER_KEY: ident})]
    lines += [json.dumps(done[k], default=str) for k in sorted(done)]
    atomic_write_text(samples_path(ckpt, suite, cfg), "\n".join(lines) + "\n")
    for path in _shard_files(ckpt, suite, cfg):
        path.unlink()
    return len(done)


def is_done(cfg: ExperimentConfig, checkpoint: str | Path, suite: str) -> bool:
    """An up-to-date result exists (this identity, intact, from the current samples file)."""
    ckpt = check_checkpoint(checkpoint)
    ident = identity(cfg, ckpt, suite)
    return result_matches(
        load_result(result_path(ckpt, suite, cfg)), ident, samples_path(ckpt, suite, cfg)
    )


def _missing(cfg: ExperimentConfig, suite: str, done: Mapping[str, Any]) -> dict[str, int]:
    """Records still missing from ``done``, by unit (RULER ``task@length`` cells, lm-eval unit
    keys); empty for a suite that is not split."""
    if is_lm_eval(suite):
        return {u.key: 1 for u in lm_eval_suites.units(cfg, suite) if u.key not in done}
    if suite != "ruler":
        return {}
    r = cfg.evaluation.ruler
    pending, _ = plan_samples(
        selected_tasks(r.tasks, r.exclude), r.lengths, r.num_samples, data_paths(cfg), done
    )
    return {f"{task}@{length}": len(left) for (task, length), left in pending.items() if left}


def missing_report(cfg: ExperimentConfig, checkpoint: str | Path, suite: str) -> str:
    """Why an evaluation is not complete, in one line: the records still missing, and every
    samples or shard file whose header names another identity (its records are ignored, so
    a merge would generate them again). Printed by a shard that cannot merge and by a merge
    that must generate records, so a run's log says what was recomputed and why."""
    ckpt = check_checkpoint(checkpoint)
    ident = identity(cfg, ckpt, suite)
    done = _records(cfg, ckpt, suite)
    missing = _missing(cfg, suite, done)
    units = sorted(missing)[:6]
    if suite == "ruler":
        what = f"{sum(missing.values())} RULER samples missing in {len(missing)} cell(s) {units}"
    elif is_lm_eval(suite):
        what = f"{len(missing)} lm-eval unit(s) missing {units}"
    else:
        what = "not sharded (one unit)"
    foreign = []
    for path in [samples_path(ckpt, suite, cfg), *_shard_files(ckpt, suite, cfg)]:
        header = (read_jsonl(path)[:1] or [{}])[0].get(HEADER_KEY) if path.is_file() else None
        if header is not None and header != ident:
            differs = sorted(k for k, v in ident.items() if header.get(k) != v)
            foreign.append(f"{path.name} (other {', '.join(differs)})")
    return f"{len(done)} recorded, {what}" + (
        f"; ignored as another identity's: {foreign}" if foreign else ""
    )


def _complete(cfg: ExperimentConfig, checkpoint: Path, suite: str, count: int) -> bool:
    """Every record of the evaluation is in the samples or shard files (a single shard owns
    every unit, so once it has run nothing is missing)."""
    if count == 1 or (suite != "ruler" and not is_lm_eval(suite)):
        return True
    return not _missing(cfg, suite, _records(cfg, checkpoint, suite))


def finalize_if_complete(
    cfg: ExperimentConfig, checkpoint: str | Path, suite: str, count: int, *, progress: bool = False
) -> Path | None:
    """Called by a shard when it is done: the shard that completes the evaluation merges it
    and writes the result in its own process, where the model is loaded already, so that no
    merge process loads it again. Returns the result, or None while other shards still run.

    The check runs under a lock on the evaluation directory: each shard's records are written
    before it checks, so of shards finishing together the last to check sees them all."""
    ckpt = check_checkpoint(checkpoint)
    out = result_path(ckpt, suite, cfg)
    with open(out.with_name(f"{suite_stem(suite)}.finalize.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_done(cfg, ckpt, suite):
            return out
        if not _complete(cfg, ckpt, suite, count):
            return None
        return finalize(cfg, ckpt, suite, progress=progress)


def finalize(
    cfg: ExperimentConfig, checkpoint: str | Path, suite: str, *, progress: bool = False
) -> Path:
    """Merge the shards and write ``<suite>.json`` (generating whatever is still missing)."""
    merge_shards(cfg, checkpoint, suite)
    return evaluate_checkpoint(cfg, checkpoint, suite, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, type=Path, help="ExperimentConfig as JSON.")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--suite", required=True)
    p.add_argument("--shard", nargs=2, type=int, metavar=("INDEX", "COUNT"))
    p.add_argument("--units", nargs="*", default=[WHOLE])
    p.add_argument("--finalize", action="store_true")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="With --shard: compile the shard's decode steps (kept by this process, and in "
        "torch's on-disk caches) and build its prefill attention plans; prefill and decoding "
        "are skipped, nothing is written. --checkpoint may be any model of the evaluated one's "
        "architecture.",
    )
    p.add_argument(
        "--finalize-when-complete",
        action="store_true",
        help="With --shard: the shard that completes the evaluation also merges it.",
    )
    p.add_argument(
        "--checkpoint-hash",
        metavar="TOKEN",
        help="The checkpoint's content hash as the caller computed it, with its files' "
        "signature (results.checkpoint_hash_token): used while the files keep that signature "
        "(names, sizes, modification times, inodes), instead of reading them all again.",
    )
    args = p.parse_args(argv)

    cfg = ExperimentConfig.model_validate_json(args.config.read_text())
    if args.checkpoint_hash:
        trust_checkpoint_hash(args.checkpoint, args.checkpoint_hash)
    if args.finalize:
        if not is_done(cfg, args.checkpoint, args.suite):
            # After every shard ran, a merge that still has records to generate is worth a
            # line: the log then says what was recomputed and why.
            print(f"merge: {missing_report(cfg, args.checkpoint, args.suite)}")
        print(finalize(cfg, args.checkpoint, args.suite))
    elif args.shard and args.compile_only:
        timing: dict[str, float] = {}
        planned = compile_shard(cfg, args.checkpoint, args.suite, args.units, timing=timing)
        print(json.dumps({"compile_timing": {k: round(v, 3) for k, v in timing.items()}}))
        print(f"compiled the decode steps of {planned} samples")
    elif args.shard:
        timing = {}
        out = run_shard(cfg, args.checkpoint, args.suite, args.units, *args.shard, timing=timing)
        # Where a shard's time goes (the bench reads it); the last line stays the shard file.
        print(json.dumps({"shard_timing": {k: round(v, 3) for k, v in timing.items()}}))
        if args.finalize_when_complete:
            result = finalize_if_complete(cfg, args.checkpoint, args.suite, args.shard[1])
            if result:
                print(f"merged: {result}")
            else:
                why = missing_report(cfg, args.checkpoint, args.suite)
                print(f"merged: not yet (other shards running?): {why}")
        print(out)
    else:
        print("give --shard INDEX COUNT or --finalize", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
