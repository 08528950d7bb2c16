"""RULER sample generation: budgets, haystack fill, answers present, templates as published."""

from __future__ import annotations

import itertools
import re

import pytest

from anchorctx.demo.fixtures import write_ruler_fixtures
from anchorctx.evaluation.ruler import TASKS, MissingDataError, generate
from anchorctx.evaluation.ruler.generate import token_counter

# The published prompts, copied here independently of the library's constants (NVIDIA/RULER
# scripts/data/synthetic/constants.py, niah.py's singular rewrite, qa.py's DOCUMENT_PROMPT).
NIAH_HEAD_SINGULAR = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n"
)
NIAH_HEAD_PLURAL = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NIAH_HEAD_UUID = NIAH_HEAD_SINGULAR.replace("number", "uuid")
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. "
)
FWE_TAIL = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the "
    "three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words."
)

# The demo tokenizer spends ~1.7 characters per token; CWE's fixed part (one-shot example plus
# 10 words x 30 repeats) alone is ~4.3K such tokens, so it runs at 8K here (RULER's own rule:
# the full-size CWE from 4096 up).
LENGTH = {task: 4096 for task in TASKS} | {"cwe": 8192}
NUM = 3


@pytest.fixture(scope="module")
def tokenizer(demo_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_corpus.tokenizer_dir))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {k: str(v) for k, v in write_ruler_fixtures(tmp_path_factory.mktemp("ruler")).items()}


@pytest.fixture(scope="module")
def samples(tokenizer, paths):
    return {t: generate(t, LENGTH[t], tokenizer, NUM, **paths) for t in TASKS}


def test_thirteen_tasks_in_ruler_order():
    assert TASKS == (
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    )


@pytest.mark.parametrize("task", TASKS)
def test_budget_filled_and_respected(task, samples, tokenizer):
    count, target = token_counter(tokenizer), LENGTH[task]
    assert len(samples[task]) == NUM
    for s in samples[task]:
        prompt_tokens = count(s["input"] + s["answer_prefix"])
        assert s["length"] == prompt_tokens + s["max_new_tokens"]
        assert s["length"] <= target, (task, s["length"])
    # Sample 0 sizes the haystack (RULER's probe), so it fills the budget; the others keep that
    # size unless they overflow, and then drop whole steps (RULER), so they may be much shorter.
    # FWE grows in steps of max_len // 32 words (~3.3 demo tokens each, ~10 % of 4K) and stops
    # one step below the budget, so its sample 0 may be a whole step short.
    fill = 0.8 if task == "fwe" else 0.9
    assert fill * target <= samples[task][0]["length"], (task, samples[task][0]["length"])


@pytest.mark.parametrize("task", ["niah_single_2", "qa_1"])
def test_tight_fit_fills_every_sample(task, tokenizer, paths):
    for s in generate(task, LENGTH[task], tokenizer, NUM, fit="tight", **paths):
        assert 0.9 * LENGTH[task] <= s["length"] <= LENGTH[task], (task, s["length"])


@pytest.mark.parametrize("task", TASKS)
def test_answers_in_haystack(task, samples):
    for s in samples[task]:
        found = [ref in s["input"] for ref in s["outputs"]]
        # QA references are aliases (any one counts); everything else needs every reference.
        assert any(found) if task.startswith("qa") else all(found), (task, s["outputs"])


def test_max_new_tokens_per_task(samples):
    expected = {"vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32}
    for task in TASKS:
        assert samples[task][0]["max_new_tokens"] == expected.get(task, 128)


def test_niah_templates(samples):
    s = samples["niah_single_1"][0]
    key = re.search(r"for (\S+) mentioned in the provided text\?$", s["input"]).group(1)
    assert s["input"].startswith(NIAH_HEAD_SINGULAR)
    assert s["input"].endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    )
    assert (
        s["answer_prefix"]
        == f" The special magic number for {key} mentioned in the provided text is"
    )
    assert (
        "\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        in s["input"]
    )
    assert f"One of the special magic numbers for {key} is: {s['outputs'][0]}." in s["input"]
    assert samples["niah_single_3"][0]["input"].startswith(NIAH_HEAD_UUID)
    for task in ("niah_multivalue", "niah_multiquery"):
        m = samples[task][0]
        assert m["input"].startswith(NIAH_HEAD_PLURAL)
        assert m["answer_prefix"].startswith(" The special magic numbers for ")
        assert m["answer_prefix"].endswith(" mentioned in the provided text are")
        assert len(m["outputs"]) == 4
    assert ", and " in samples["niah_multiquery"][0]["answer_prefix"]  # four keys, listed


def test_niah_needle_haystack_and_depths(samples):
    lines = samples["niah_multikey_2"][0]["input"].split("\n")[1:-1]
    assert len(lines) > 20 and all(
        line.startswith("One of the special magic numbers for ") for line in lines
    )
    uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
    assert uuid.match(samples["niah_multikey_3"][0]["outputs"][0])
    assert re.fullmatch(r"\d{7}", samples["niah_single_2"][0]["outputs"][0])


def test_vt_one_shot_and_chain(samples):
    s = samples["vt"][0]
    assert s["input"].startswith(VT_HEAD)  # the one-shot example comes first
    assert s["input"].count(VT_HEAD) == 2
    value = re.search(r"assigned the value (\d{5}) in the text above\.$", s["input"]).group(1)
    assert s["answer_prefix"] == (
        " Answer: According to the chain(s) of variable assignment in the text above, 5 variables"
        f" are assigned the value {value}, they are: "
    )
    names = s["outputs"]
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    assert f"VAR {names[0]} = {value}" in s["input"]
    for a, b in itertools.pairwise(names):
        assert f"VAR {b} = VAR {a} " in s["input"]
    shot = s["input"].split("\n" + VT_HEAD)[0]
    # One-shot answer: 3-letter names after the prefix (its trailing space plus the joining one).
    assert re.search(r"they are:  ([A-Z]{3} ){4}[A-Z]{3}\n$", shot)


def test_cwe_one_shot_and_counts(samples):
    s = samples["cwe"][0]
    assert s["input"].startswith(CWE_HEAD) and s["input"].endswith(CWE_QUESTION)
    assert s["answer_prefix"] == CWE_PREFIX
    assert s["input"].count(CWE_PREFIX) == 1  # the one-shot example's answer
    question = s["input"].split("\n" + CWE_HEAD)[1]
    words = re.findall(r"\d+\. (\S+)", question)
    for w in s["outputs"]:
        assert words.count(w) == 30
    assert {words.count(w) for w in set(words) - set(s["outputs"])} == {3}


def test_fwe_zipf_answer(samples):
    s = samples["fwe"][0]
    assert s["input"].startswith(FWE_HEAD) and s["input"].endswith(FWE_TAIL)
    assert s["answer_prefix"] == FWE_PREFIX
    words = s["input"][len(FWE_HEAD) : -len(FWE_TAIL)].split()
    ranked = sorted(set(words), key=words.count, reverse=True)
    assert ranked[0] == "..." and ranked[1:4] == s["outputs"]


def test_qa_documents(samples):
    for task in ("qa_1", "qa_2"):
        s = samples[task][0]
        assert s["input"].startswith(
            QA_INSTRUCTION + "\n\nThe following are given documents.\n\nDocument 1:\n"
        )
        assert f"\n\n{QA_INSTRUCTION}\n\nQuestion: " in s["input"]
        assert s["answer_prefix"] == " Answer:"
        numbers = [int(n) for n in re.findall(r"(?:^|\n\n)Document (\d+):\n", s["input"])]
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 3
    assert samples["qa_1"][0]["outputs"] == ["Harbor00", "the Harbor00"]  # sample i = question i


def test_samples_independent_of_each_other(tokenizer, paths, samples):
    """Resume regenerates only missing indices: sample i alone equals sample i of a full run."""
    for task in ("niah_single_2", "vt", "qa_2"):
        alone = generate(task, LENGTH[task], tokenizer, NUM, indices=[2], **paths)
        assert alone == [samples[task][2]]
    assert generate("fwe", 4096, tokenizer, 2) == samples["fwe"][:2]


@pytest.mark.parametrize(
    "task,key", [("niah_single_2", "essay_path"), ("qa_1", "squad_path"), ("qa_2", "hotpotqa_path")]
)
def test_missing_data_file(task, key, tokenizer, tmp_path):
    with pytest.raises(MissingDataError, match=f"evaluation.ruler.{key} is not set"):
        generate(task, 4096, tokenizer, 1)
    with pytest.raises(MissingDataError, match="missing file"):
        generate(task, 4096, tokenizer, 1, **{key: str(tmp_path / "absent.json")})


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="unknown RULER task 'niah'"):
        generate("niah", 4096, tokenizer, 1)
    with pytest.raises(TypeError, match="essay_dir"):
        generate("niah_single_1", 4096, tokenizer, 1, essay_dir="x")
    with pytest.raises(ValueError, match="longer length"):
        generate("cwe", 1024, tokenizer, 1)
