"""RULER task-format pretraining documents (``anchorctx.demo.pretrain_corpus``), the base model's
evaluation restricted to its pretraining length (``ExperimentConfig.pretraining``) and the
report's base-model section (``write_experiment_report(..., base=...)``)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from anchorctx.demo import pretrain_corpus as pc
from anchorctx.experiment import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
GPU_SMALL = ROOT / "configs" / "gpu-small.yaml"
# 0.25 x 2048 = 512 tokens: too short for three tasks' templates with the demo tokenizer (their
# documents move to 1024), long enough for the others.
SEQ_LEN = 2048
SEED = 7
PER_CELL = 2
COUNT = PER_CELL * len(pc.TASK_FORMAT_TASKS) * len(pc.TASK_FORMAT_LENGTHS)
LENGTHS = sorted(int(f * SEQ_LEN) for f in pc.TASK_FORMAT_LENGTHS)
EVAL_SEED = 42  # evaluation.ruler.seed's default
ENGLISH = 0.5  # english_haystack_share of the documents tested here (0 by default)


# --------------------------------------------------------------------------- documents
@pytest.fixture(scope="module")
def tokenizer(demo_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))


@pytest.fixture(scope="module")
def formatted(demo_corpus, tmp_path_factory):
    """(work dir, documents) of one task_format_documents call."""
    work = tmp_path_factory.mktemp("task_format") / "work"
    docs = pc.task_format_documents(
        COUNT,
        seed=SEED,
        tokenizer=demo_corpus.tokenizer_dir,
        seq_len=SEQ_LEN,
        work=work,
        english_share=ENGLISH,
    )
    return work, docs


def _cells(docs) -> Counter:
    """Documents per (task, length) as generated."""
    return Counter((task, length) for task, length, _ in docs)


def _samples(
    tokenizer, work: Path, task: str, length: int, n: int, seed: int, haystack: str = "pseudo"
) -> list[dict]:
    from anchorctx.evaluation.ruler.generate import generate

    try:
        return generate(
            task, length, tokenizer, n, seed, fit="tight", **pc.haystack_paths(work, haystack)
        )
    except ValueError:  # too short for this haystack: its documents moved to the next length
        return []


def _haystacks(task: str) -> list[str]:
    return list(pc.HAYSTACKS) if task in pc.ESSAY_TASKS else ["pseudo"]


def test_task_format_documents_count_tasks_and_lengths(formatted, tokenizer, demo_corpus, tmp_path):
    """`count` documents, every task the same number of times, each within the pretraining
    length in tokens and starting with a RULER template."""
    _, docs = formatted
    assert len(docs) == COUNT
    per_task = PER_CELL * len(pc.TASK_FORMAT_LENGTHS)
    assert Counter(task for task, _, _ in docs) == dict.fromkeys(pc.TASK_FORMAT_TASKS, per_task)
    openings = {
        "niah": ("A special magic", "Some special magic"),
        "vt": ("Memorize and track the chain(s) of variable assignment",),
        "fwe": ("Read the following coded text",),
    }
    for task, length, text in docs:
        assert text.startswith(openings[task.split("_")[0]]), (task, text[:80])
        assert length in LENGTHS
        assert len(tokenizer(text).input_ids) <= length, (task, length)
    # Every task at every length where its template fits; the 512-token documents of the uuid
    # multikey and variable-tracking tasks (whose templates and one-shot examples alone are
    # longer) and of multiquery over the pseudo-word haystack moved to their next length.
    cells = _cells(docs)
    for task in pc.TASK_FORMAT_TASKS:
        expected = dict.fromkeys(LENGTHS, PER_CELL)
        if task in ("niah_multikey_3", "vt"):
            expected = {LENGTHS[1]: 2 * PER_CELL, LENGTHS[2]: PER_CELL}
        if task == "niah_multiquery":  # the pseudo-word half moved; the English half fits 512
            half = PER_CELL // 2
            expected = {LENGTHS[0]: half, LENGTHS[1]: PER_CELL + half, LENGTHS[2]: PER_CELL}
        assert {n: cells[task, n] for n in LENGTHS if cells[task, n]} == expected, task
    longest = max(len(tokenizer(t).input_ids) for _, _, t in docs)
    assert longest > 0.75 * SEQ_LEN, longest
    # Fewer documents than cells: exactly that many still.
    few = pc.task_format_documents(
        7, seed=SEED, tokenizer=demo_corpus.tokenizer_dir, seq_len=SEQ_LEN, work=tmp_path / "w"
    )
    assert len(few) == 7 and {task for task, _, _ in few} <= set(pc.TASK_FORMAT_TASKS)


def test_task_format_documents_too_short_for_every_length_is_an_error(demo_corpus, tmp_path):
    """A pretraining length too short for a task at every length: the generator's error, not
    silently fewer documents."""
    with pytest.raises(ValueError, match=r"niah_\w+.*longer length"):
        pc.task_format_documents(
            len(pc.TASK_FORMAT_TASKS),
            seed=SEED,
            seq_len=300,
            tokenizer=demo_corpus.tokenizer_dir,
            work=tmp_path / "w",
        )


def test_task_format_documents_end_with_their_reference_answers(formatted, tokenizer):
    """Each document is a RULER sample of the corpus seed (+ its haystack's offset) at its
    cell's length over one of its task's haystacks: prompt, answer prefix, then exactly the
    sample's reference answers, each of which is in the document before its question line; the
    document fits the cell's length. Essay tasks use both haystacks, about half each."""
    work, docs = formatted
    remaining = Counter(text for _, _, text in docs)
    task_of = {text: task for task, _, text in docs}
    used: Counter = Counter()
    for (task, length), n in _cells(docs).items():
        for haystack in _haystacks(task):
            seed = pc.haystack_seed(SEED, haystack)
            for s in _samples(tokenizer, work, task, length, n, seed, haystack):
                prompt = s["input"] + s["answer_prefix"]
                matches = [t for t in remaining if remaining[t] and t.startswith(prompt)]
                assert len(matches) <= 1, (task, length, s["index"])
                if not matches:  # more samples generated here than the cell's share
                    continue
                text = matches[0]
                remaining[text] -= 1
                used[task, haystack] += 1
                assert task_of[text] == task
                answers = [a for a in re.split(r"[,\s]+", text[len(prompt) :]) if a]
                assert answers == list(s["outputs"]) and answers, (task, text[-200:])
                body = text.rsplit("\n", 1)[0]
                for answer in answers:
                    assert answer in body, (task, answer)
                assert len(tokenizer(text).input_ids) <= length, (task, length)
    assert not +remaining  # every document accounted for
    per_task = PER_CELL * len(pc.TASK_FORMAT_LENGTHS)
    for task in pc.TASK_FORMAT_TASKS:
        if task in pc.ESSAY_TASKS:
            assert used[task, "pseudo"] == used[task, "english"] == per_task // 2, task
        else:
            assert used[task, "pseudo"] == per_task, task


def test_english_haystack_share_splits_only_the_essay_tasks():
    """english_haystack_share 0 (the default): every job on the pseudo-word haystack, as before
    the option existed; 0.5: half of each essay task's cells (rounded down) on the English one,
    the other tasks untouched; the same documents in total either way."""

    def counts(jobs):
        out = Counter()
        for task, haystack, cells in jobs:
            out[task, haystack] += sum(k for _, k in cells)
        return out

    plain = counts(pc._task_format_jobs(COUNT, SEQ_LEN))
    assert {h for _, h in plain} == {"pseudo"} and sum(plain.values()) == COUNT
    split = counts(pc._task_format_jobs(COUNT, SEQ_LEN, ENGLISH))
    assert sum(split.values()) == COUNT
    for task in pc.TASK_FORMAT_TASKS:
        english = split[task, "english"]
        assert english == (plain[task, "pseudo"] // 2 if task in pc.ESSAY_TASKS else 0), task
        assert split[task, "pseudo"] + english == plain[task, "pseudo"]


def test_english_haystack_is_english_prose_not_the_evaluation_essay(formatted):
    """The English haystack: sentences of wonderwords' words in this module's templates (never
    the evaluation essays' "... near <place>." template), deterministic in its seed."""
    import random

    from anchorctx.demo.fixtures import PLACES

    work, _ = formatted
    text = json.loads(pc.haystack_paths(work, "english")["essay_path"].read_text())["text"]
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 0.9 * pc._HAYSTACK_WORDS
    english = pc.english_words()
    function = {
        "a",
        "can",
        "the",
        "of",
        "many",
        "when",
        "is",
        "it",
        "to",
        "with",
        "every",
        "will",
        "its",
        "in",
        "time",
        "we",
        "because",
        "was",
        "and",
        "nobody",
        "would",
        "without",
    }
    assert sum(w in english or w in function for w in words) / len(words) > 0.99
    assert not any(f" near {place}." in text for place in PLACES)
    again = pc.english_prose(random.Random(pc.haystack_seed(SEED, "english")), pc._HAYSTACK_WORDS)
    assert again == text
    assert pc.english_prose(random.Random(1), 500) != pc.english_prose(random.Random(2), 500)


def test_task_format_documents_are_deterministic_and_seeded(formatted, demo_corpus, tmp_path):
    """The same seed gives identical documents (another work dir); another seed others."""
    _, docs = formatted
    kw = {"tokenizer": demo_corpus.tokenizer_dir, "seq_len": SEQ_LEN, "english_share": ENGLISH}
    assert pc.task_format_documents(COUNT, seed=SEED, work=tmp_path / "a", **kw) == docs
    other = pc.task_format_documents(COUNT, seed=SEED + 1, work=tmp_path / "b", **kw)
    assert len(other) == COUNT
    assert not {t for _, _, t in other} & {t for _, _, t in docs}


def test_task_format_documents_do_not_depend_on_workers(formatted, demo_corpus, tmp_path):
    """Generated in two processes: the very same documents in the same order."""
    _, docs = formatted
    kw = {"tokenizer": demo_corpus.tokenizer_dir, "seq_len": SEQ_LEN, "english_share": ENGLISH}
    assert pc.task_format_documents(COUNT, seed=SEED, work=tmp_path / "a", workers=2, **kw) == docs


def test_task_format_documents_share_no_prompt_with_the_evaluation(formatted, tokenizer):
    """No document's prompt is an evaluation sample's (seed 42) of the same task and length,
    even over the very same haystack."""
    work, docs = formatted
    texts = [t for _, _, t in docs]
    for task, length in _cells(docs):
        for haystack in _haystacks(task):
            for s in _samples(tokenizer, work, task, length, 3, EVAL_SEED, haystack):
                prompt = s["input"] + s["answer_prefix"]
                assert not any(t.startswith(prompt) for t in texts), (task, length)
                assert not any(t.startswith(s["input"]) for t in texts), (task, length)


# --------------------------------------------------------------------------- the corpus
def _lines(files: list[Path]) -> list[dict]:
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_write_pretrain_corpus_with_task_format_documents(demo_corpus, tmp_path):
    """task_format_documents > 0 writes FILES task_format_<i>.jsonl files with that many
    documents, records the parameters, and a second identical call reuses the corpus."""
    out = tmp_path / "c"
    # Six fill the first two tasks' cells (documents go to the cells task by task, one at each
    # of the three lengths): niah_single_1 (noise haystack) and niah_single_2 (essay haystack),
    # so the call with workers below still runs two generation jobs in its two processes, and
    # every file gets documents. Twelve added two more essay-haystack tasks: both processes then
    # imported NLTK's sentence splitter (~3 s of CPU each) and generated twice as much.
    count = 6
    kw = {
        "seed": 1,
        "documents": 10,
        "task_format_documents": count,
        "tokenizer": demo_corpus.tokenizer_dir,
        "seq_len": SEQ_LEN,
    }
    data = pc.write_pretrain_corpus(out, **kw)
    assert data == out / "data"
    formatted = sorted(data.glob("task_format_*.jsonl"))
    assert [f.name for f in formatted] == [f"task_format_{i}.jsonl" for i in range(pc.FILES)]
    rows = _lines(formatted)
    assert len(rows) == count
    assert {r["meta"]["redpajama_set_name"] for r in rows} == {pc.DOMAIN}
    assert all(
        "special magic" in r["text"] or "VAR " in r["text"] or "coded" in r["text"] for r in rows
    )
    plain = [f for f in sorted(data.glob("*.jsonl")) if f not in formatted]
    assert len(plain) == pc.FILES and len(_lines(plain)) == 10
    marker = json.loads((out / "pretrain.json").read_text())
    task_format = marker["params"]["task_format"]
    assert task_format["documents"] == count and task_format["seq_len"] == SEQ_LEN
    assert re.fullmatch(r"[0-9a-f]{16}", task_format["tokenizer"])
    assert marker["params"]["version"] == pc.PRETRAIN_CORPUS_VERSION
    assert "english_share" not in task_format  # the default: the corpus' identity is unchanged
    assert sum(marker["kinds"].values()) == 10 + count
    assert sum(marker["kinds"].get(t, 0) for t in pc.TASK_FORMAT_TASKS) == count
    # Written with workers (the five kinds in a side process meanwhile): the same files.
    pc.write_pretrain_corpus(tmp_path / "w", **kw, workers=2)
    for f in sorted(data.glob("*.jsonl")):
        assert (tmp_path / "w" / "data" / f.name).read_bytes() == f.read_bytes(), f.name
    stamps = [f.stat().st_mtime_ns for f in formatted]
    assert pc.write_pretrain_corpus(out, **kw) == data
    assert [f.stat().st_mtime_ns for f in formatted] == stamps
    # Other task-format parameters: rewritten.
    pc.write_pretrain_corpus(out, **{**kw, "task_format_documents": 5})
    assert len(_lines(sorted(data.glob("task_format_*.jsonl")))) == 5
    assert (
        json.loads((out / "pretrain.json").read_text())["params"]["task_format"]["documents"] == 5
    )
    # The English haystack share is part of the corpus' identity: rewritten, and recorded.
    pc.write_pretrain_corpus(out, **{**kw, "english_haystack_share": ENGLISH})
    params = json.loads((out / "pretrain.json").read_text())["params"]["task_format"]
    assert params["english_share"] == ENGLISH
    assert (out / "data" / "task_format_0.jsonl").is_file()


def test_write_pretrain_corpus_task_format_needs_a_tokenizer(tmp_path):
    """task_format_documents > 0 without a tokenizer is a ValueError naming model.tokenizer."""
    with pytest.raises(ValueError, match=r"model\.tokenizer"):
        pc.write_pretrain_corpus(tmp_path / "c", seed=1, documents=10, task_format_documents=3)
    assert not (tmp_path / "c" / "pretrain.json").exists()


def test_write_pretrain_corpus_without_task_format_is_unchanged(tmp_path):
    """task_format_documents=0 (the default): no task_format files, no task_format parameter."""
    data = pc.write_pretrain_corpus(tmp_path / "c", seed=1, documents=10, task_format_documents=0)
    assert not list(data.glob("task_format_*"))
    files = sorted(data.glob("*.jsonl"))
    assert len(files) == pc.FILES and len(_lines(files)) == 10
    params = json.loads((tmp_path / "c" / "pretrain.json").read_text())["params"]
    assert params == {"version": pc.PRETRAIN_CORPUS_VERSION, "seed": 1, "documents": 10}


# --------------------------------------------------------------------------- the config
def test_pretraining_evaluates_ruler_at_the_pretraining_length():
    """gpu-small: the base model's RULER lengths are those <= its pretraining seq_len (2048);
    the experiment's own evaluation keeps every length."""
    cfg = load_config(GPU_SMALL)
    assert cfg.evaluation.ruler.lengths == [2048, 4096, 8192, 16384]
    pre = cfg.pretraining()
    assert pre.data.seq_len == 2048
    assert pre.evaluation.ruler.lengths == [2048]
    assert pre.evaluation.suites == ["ruler", "mmlu", "hellaswag"]
    assert cfg.evaluation.ruler.lengths == [2048, 4096, 8192, 16384]  # not mutated
    # A longer pretraining length keeps every length up to it.
    raw = cfg.model_dump(mode="json")
    raw["pretrain"]["overrides"]["data.seq_len"] = 8192
    assert config_from_dict(raw).pretraining().evaluation.ruler.lengths == [2048, 4096, 8192]


def test_pretraining_drops_ruler_when_no_length_fits():
    """RULER lengths all above the pretraining length: the base model's suites lose ruler;
    the pretraining run's name does not depend on the evaluation section."""
    cfg = load_config(GPU_SMALL)
    short = load_config(GPU_SMALL, ["evaluation.ruler.lengths=[4096, 8192]"])
    assert short.evaluation.ruler.lengths == [4096, 8192]
    pre = short.pretraining()
    assert "ruler" not in pre.evaluation.suites
    assert pre.evaluation.suites == ["mmlu", "hellaswag"]
    assert pre.variant_name == cfg.pretraining().variant_name
    assert re.fullmatch(r"pretrain-[0-9a-f]{10}", pre.variant_name)
    other_eval = load_config(GPU_SMALL, ["evaluation.last_k=1", "evaluation.ruler.num_samples=8"])
    assert other_eval.pretraining().variant_name == cfg.pretraining().variant_name
    assert other_eval.base_model_path == cfg.base_model_path
    # A change to what is pretrained does rename it.
    deeper = load_config(GPU_SMALL, ["model.tiny.num_hidden_layers=6"])
    assert deeper.pretraining().variant_name != cfg.pretraining().variant_name


# --------------------------------------------------------------------------- the report
def _write_result(run_dir: Path, step: int, suite: str, scores: dict, counts: dict) -> None:
    path = run_dir / "eval" / f"step-{step}" / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"suite": suite, "step": step, "scores": scores, "counts": counts}))


def _fake_run(run_dir: Path, step: int, ruler: dict[str, dict[str, float]], mmlu: float) -> None:
    from anchorctx.evaluation.averaging import summarize_run

    counts = {t: dict.fromkeys(by_len, 56) for t, by_len in ruler.items()}
    _write_result(run_dir, step, "ruler", ruler, counts)
    _write_result(run_dir, step, "mmlu", {"mmlu": {"acc": mmlu}}, {"mmlu": 400})
    summarize_run(run_dir, 1)


def _section(md: str, start: str, end: str) -> str:
    assert start in md, start
    tail = md.split(start, 1)[1]
    return tail.split(end, 1)[0] if end in tail else tail


def _table_rows(section: str) -> list[str]:
    """The first cell of each data row of the first markdown table in ``section``."""
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [r.split("|")[1].strip() for r in rows[1:]]


BASE = "pretrain-0123456789"
ARMS = ["full", "anchor"]


@pytest.fixture
def experiment(tmp_path) -> Path:
    """Two arms at 2K and 4K; the base model at 2K only (its pretraining length)."""
    exp = tmp_path / "exp"
    _fake_run(
        exp / "full",
        50,
        {"niah_single_1": {"2048": 90.0, "4096": 40.0}, "vt": {"2048": 70.0, "4096": 20.0}},
        mmlu=30.0,
    )
    _fake_run(
        exp / "anchor",
        50,
        {"niah_single_1": {"2048": 95.0, "4096": 60.0}, "vt": {"2048": 75.0, "4096": 30.0}},
        mmlu=31.0,
    )
    return exp


def test_report_has_a_base_model_section_and_first_row(experiment):
    """With the base model's summary: its own section with its per-task RULER table, the first
    row of Table 5 and Table 7 (MMLU, HellaSwag: the paper's numbering); report.json names it
    apart from the arms."""
    from anchorctx.evaluation.report import write_experiment_report

    _fake_run(
        experiment / BASE, 700, {"niah_single_1": {"2048": 80.0}, "vt": {"2048": 60.0}}, mmlu=27.0
    )
    out = write_experiment_report(experiment, ARMS, base=BASE)
    md = (experiment / "report.md").read_text()
    assert md == out["markdown"]
    section = _section(md, f"## Base model: `{BASE}`", "## Scores")
    assert md.index(f"## Base model: `{BASE}`") < md.index("## Scores")
    assert "| **average** | 70.00 |" in section
    assert "| niah_single_1 | 80.00 |" in section and "| vt | 60.00 |" in section
    assert "| task | 2K |" in section and "4K" not in section  # at its pretraining length only
    assert "95.00" not in section  # no arm's score in the base's section
    table5 = _section(md, "### Table 5", "### Table 12")
    assert _table_rows(table5) == [BASE, *ARMS]
    assert f"| {BASE} | 70.00 | — |" in table5
    assert "| full | 80.00 | 30.00 |" in table5 and "| anchor | 85.00 | 45.00 |" in table5
    assert _table_rows(_section(md, "### Table 7", "\n\n#"))[0] == BASE
    # niah_single_1 at 80 meets the bar (>=); its check is named in the section and the JSON.
    assert "**Retrieval check: met** (niah_single_1 80.0 at 2K; the bar is 80 on each)" in section
    report = json.loads((experiment / "report.json").read_text())
    assert report["base_check"] == {
        "passed": True,
        "bar": 80.0,
        "scores": {"niah_single_1": {"2048": 80.0}},
    }
    assert report["base"] == BASE and report["variants"] == ARMS
    assert set(report["runs"]) == {BASE, *ARMS}
    assert list(report["tables"]["ruler"]["rows"]) == [BASE, *ARMS]


def test_report_says_when_the_base_model_does_not_retrieve(experiment):
    """A base model under the bar on either single-needle task at its own length: the report
    says the check is not met and why the arms' RULER scores then say little (run 6's case);
    a base model scored on neither task gets no check."""
    from anchorctx.evaluation.report import write_experiment_report

    _fake_run(
        experiment / BASE,
        1200,
        {"niah_single_1": {"2048": 96.4}, "niah_single_2": {"2048": 76.8}},
        mmlu=25.0,
    )
    md = write_experiment_report(experiment, ARMS, base=BASE)["markdown"]
    section = _section(md, f"## Base model: `{BASE}`", "## Scores")
    assert (
        "**Retrieval check: not met** (niah_single_1 96.4 at 2K, niah_single_2 76.8 at 2K; "
        "the bar is 80 on each)"
    ) in section
    assert "say little about the attention variants" in section
    assert not json.loads((experiment / "report.json").read_text())["base_check"]["passed"]
    _fake_run(experiment / BASE, 1200, {"vt": {"2048": 50.0}}, mmlu=25.0)
    md = write_experiment_report(experiment, ARMS, base=BASE)["markdown"]
    assert "Retrieval check" not in md
    assert json.loads((experiment / "report.json").read_text())["base_check"] is None


def test_report_without_the_base_summary_has_no_base(experiment):
    """base named but never evaluated: no base section or row, report.json's base is None;
    the same as no base at all."""
    from anchorctx.evaluation.report import write_experiment_report

    out = write_experiment_report(experiment, ARMS, base=BASE)
    md = out["markdown"]
    assert "## Base model" not in md and BASE not in md
    assert _table_rows(_section(md, "### Table 5", "### Table 12")) == ARMS
    report = json.loads((experiment / "report.json").read_text())
    assert report["base"] is None and report["variants"] == ARMS and report["base_check"] is None
    assert set(report["runs"]) == set(ARMS)
    assert write_experiment_report(experiment, ARMS)["markdown"] == md
