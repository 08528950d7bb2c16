"""Issue #33, the config rows: every bad config is one line naming the file or the key, exit 2,
before anything is written (and nothing is ever written outside ``run_root``).

Row 2: names that become paths; row 6: bounded YAML (aliases); row 7: batch sizes; row 8: finite
floats and ranges; row 18: value ranges, booleans, duplicate keys, model shapes. CPU only, fast:
every test stops at config loading.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from anchorctx.cli import main
from anchorctx.config import ConfigError, load_yaml, path_under
from anchorctx.experiment import ExperimentConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"name": "t", "model": {"tiny": {}, "tokenizer": "tok"}}


def _config(tmp_path: Path, raw: dict | None = None, text: str | None = None) -> Path:
    """A config file under ``tmp_path`` whose run_root is ``tmp_path/runs``."""
    path = tmp_path / "c.yaml"
    if text is None:
        raw = {**MINIMAL, "run_root": str(tmp_path / "runs"), **(raw or {})}
        text = json.dumps(raw)  # JSON is YAML
    path.write_text(text)
    return path


def _fails(capsys, argv: list[str], *needles: str) -> str:
    """``anchorctx *argv`` exits 2 with one line on stderr holding every needle."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"anchorctx {argv[0]}: config error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# ----------------------------------------------------------------- row 2: names become paths
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("variant={outside}", "variant"),
        ("variant=..", "variant"),
        ("variant=.", "variant"),
        ("name=..", "name"),
        ("name=a/b", "name"),
        ("name=a\\b", "name"),
        ("variant=.anchor.lock", "variant"),  # the lock file beside run directory `anchor`
        ("variant=" + "x" * 300, "variant"),
        ("variant=data", "variant"),  # <run_root>/<name>/data holds the packed datasets
        ("name=mlflow.db", "name"),  # <run_root>/mlflow.db is the local MLflow store
        ('variants=[{{name: "..", attention: anchor}}]', "variants.0.name"),
        ("variants=[{{name: a, attention: anchor}}, {{name: a, attention: full}}]", "variants"),
    ],
)
def test_names_that_become_paths_stay_inside_run_root(tmp_path, capsys, override, key):
    """`--set variant=/abs/path`, `name=..`, `variant=..` used to write (and with --force move)
    directories outside run_root; now every name that becomes a directory is one path component,
    refused where the config is read, before `train` writes anything."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.yaml").write_text("precious\n")
    config = _config(tmp_path, {"training": {"device": "cpu", "steps": 1}})
    before = _tree(tmp_path)
    for command in ("config", "train"):
        argv = [command, str(config), "--set", override.format(outside=outside)]
        if command == "train":
            argv.append("--force")
        _fails(capsys, argv, f"{key}")
    assert (outside / "config.yaml").read_text() == "precious\n"
    assert _tree(tmp_path) == before  # nothing written, nothing moved aside


def test_run_directory_is_checked_inside_run_root(tmp_path):
    """The run directory itself is built by one checked helper: even a config that skipped
    validation cannot name a directory outside run_root."""
    good = config_from_dict({**MINIMAL, "run_root": str(tmp_path)}, ["variant=anchor"])
    assert good.run_dir == tmp_path / "t" / "anchor"
    bad = ExperimentConfig.model_construct(**{**dict(good), "variant": "../../etc"})
    with pytest.raises(ConfigError, match="variant"):
        _ = bad.run_dir
    with pytest.raises(ConfigError, match="name"):
        path_under(tmp_path, "..", key="name")
    # And the real command line, as a process: exit 2, one line.
    done = subprocess.run(
        [sys.executable, "-m", "anchorctx", "config", "configs/demo.yaml", "--set", "name=.."],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "name" in done.stderr, done.stderr


# ----------------------------------------------------------------------- row 6: bounded YAML
LAUGHS = """\
name: t
model: {tiny: {}, tokenizer: tok}
variants:
  - name: x
    attention: anchor
    overrides:
      a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
      b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
      c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
      d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
      e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
      f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
      g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
      h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
      i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_billion_laughs_fails_fast_with_bounded_memory(tmp_path, capsys):
    """A ~500-byte YAML whose aliases expand to 9**9 values took 1.8 GB before it was refused;
    now the loader counts the expanded values on the composed nodes (one visit each) and refuses
    the document before building anything from it."""
    config = _config(tmp_path, text=LAUGHS)
    assert config.stat().st_size < 600
    tracemalloc.start()
    start = time.perf_counter()
    try:
        err = _fails(capsys, ["config", str(config)], str(config), "expands to more than")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 5, "not refused fast"
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert "variants.0.overrides" in err
    # The same through --set, and an alias that contains itself.
    laughs = "[" + ", ".join(["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]) + "]"
    deep = "{a: &a [x, x, x, x, x, x, x, x, x, x], "
    deep += ", ".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]" for p, c in zip("abcdefg", "bcdefgh")
    )
    _fails(capsys, ["config", "configs/demo.yaml", "--set", f"data.mixture={deep}}}"], "override")
    with pytest.raises(Exception, match="contains itself"):
        load_yaml("a: &a [1, *a]")
    assert load_yaml(laughs) == [["lol"] * 9]  # ordinary anchors still load
    assert load_yaml("base: &b {x: 1}\nuse: {<<: *b, y: 2}") == {
        "base": {"x": 1},
        "use": {"x": 1, "y": 2},
    }


# --------------------------------------------------------------- row 7: batch sizes (config)
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["training.global_batch_size=1000000000"], "training.global_batch_size"),
        (["training.global_batch_size=1e9"], "training.global_batch_size"),
        (["training.global_batch_size=0"], "training.global_batch_size"),
        (["training.global_batch_size=5"], "training.global_batch_size=5 is not divisible"),
        (["training.micro_batch_size=8"], "training.micro_batch_size=8 is larger"),
        (
            ["training.nproc=2", "training.sequence_parallel=1", "training.global_batch_size=6"],
            "= 2 × 2 = 4",
        ),
        (["training.nproc=3", "training.sequence_parallel=2"], "training.sequence_parallel"),
        (["training.nproc=1", "training.sequence_parallel=2"], "needs at least 2 processes"),
    ],
)
def test_batch_sizes_are_checked_at_config_time(capsys, overrides, needle):
    """`training.global_batch_size=1e9` passed every check; the batch sizes are now bounded and
    split over the processes the config names as the launcher would (configs/demo.yaml: CPU,
    micro 2, global 4)."""
    argv = ["config", "configs/demo.yaml"] + [a for o in overrides for a in ("--set", o)]
    _fails(capsys, argv, "configs/demo.yaml", needle)


# --------------------------------------------------------------- row 8: finite floats, ranges
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("training.lr=.inf", "training.lr"),
        ("training.lr=.nan", "training.lr"),
        ("training.lr=inf", "training.lr"),  # the string, which pydantic would read as a float
        ("training.lr=0", "training.lr"),
        ("training.lr=5", "training.lr"),
        ("training.grad_clip=-.inf", "training.grad_clip"),
        ("training.weight_decay=.nan", "training.weight_decay"),
        ("model.rope_theta=.inf", "model.rope_theta"),
        ("data.upsample.keep_short=.nan", "data.upsample.keep_short"),
        ("data.mixture={a: .inf}", "data.mixture"),
        ("variants.0.overrides={training.lr: .inf}", "training.lr"),
        ("pretrain={overrides: {training.lr: .nan}}", "training.lr"),
    ],
)
def test_float_settings_are_finite_and_in_range(capsys, override, key):
    """`training.lr=.inf` trained with NaN; every float setting (in lists, tuples, mappings,
    arm and pretraining overrides too) is now finite and in range when the config is read."""
    _fails(capsys, ["config", "configs/demo.yaml", "--set", override], "configs/demo.yaml", key)


# ------------------------------------------------ row 18: values, booleans, keys, model shapes
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("training.betas=[2,-1]", "training.betas.0"),
        ("training.betas=[0.9, 1]", "training.betas.1"),
        ("seed=-1", "seed"),
        ("seed=4294967296", "seed"),
        ("data.demo_corpus.seed=-3", "data.demo_corpus.seed"),
        ("evaluation.ruler.seed=-1", "evaluation.ruler.seed"),
        ("training.steps=true", "training.steps: must be a number, not a boolean"),
        ("training.lr=true", "training.lr: must be a number"),
        ("training.nproc=false", "training.nproc: must be a number"),
        ("training.betas=[true, 0.9]", "training.betas: [0] must be a number"),
        ("model.tiny.hidden_size=130", "model.tiny.hidden_size=130 must be a multiple of"),
        ("model.tiny.hidden_size=132", "model.tiny.hidden_size=132 gives head_dim=33"),
        ("model.tiny.head_dim=7", "model.tiny.head_dim=7"),
        ("model.tiny.num_key_value_heads=3", "model.tiny.num_key_value_heads=3 must divide"),
        ("model.tiny.vocab_size=0", "model.tiny.vocab_size"),
    ],
)
def test_values_are_checked_when_the_config_is_read(capsys, override, needle):
    """`betas=[2,-1]`, `seed=-1` and a bad model shape passed `anchorctx config` and failed at
    run time (a shape after pages of transformers output); `steps=true` trained one step."""
    _fails(capsys, ["config", "configs/demo.yaml", "--set", override], needle)


def test_duplicate_yaml_keys_are_an_error_naming_file_key_and_line(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys; YAML forbids them and so does anchorctx."""
    config = _config(
        tmp_path,
        text="name: t\nmodel: {tiny: {}, tokenizer: tok}\ntraining:\n  steps: 5\n  lr: 1.0e-3\n"
        "  steps: 50\n",
    )
    _fails(capsys, ["config", str(config)], str(config), "line 6", "'training.steps'", "line 4")
    top = _config(tmp_path, text="name: t\nname: u\nmodel: {tiny: {}, tokenizer: tok}\n")
    _fails(capsys, ["config", str(top)], "duplicate key 'name'")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(_config(tmp_path, text="lr: 1\nlr: 2\n"))
    # --set values are YAML too.
    _fails(capsys, ["config", "configs/demo.yaml", "--set", "data.mixture={a: 1, a: 2}"], "'a'")
