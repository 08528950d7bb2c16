"""Issue #58, the input rows: a malformed ``config.json`` (row 14), the reserved run name
``external`` (row 11) and ``eval-worker`` against a server that is down. Each is one line
naming the file, the key or the server. CPU only; the one model is a tiny checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import save_checkpoint

from anchorctx.cli import main

MINIMAL = {"name": "t", "model": {"tiny": {}, "tokenizer": "tok"}}
BROKEN = '{\n  "model_type": "llama",,\n}\n'  # JSON's error: line 2 column 25


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "real_accelerator.py" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"anchorctx {command}: "), err
    return lines[0]


# ------------------------------------------------------------- row 14: a malformed config.json
@pytest.fixture
def broken_checkpoint(demo_corpus, tmp_path) -> Path:
    path = tmp_path / "step-000010"
    save_checkpoint(path, demo_corpus.tokenizer_dir, seed=0, step=10)
    (path / "config.json").write_text(BROKEN)
    return path


def test_lm_eval_dtype_auto_names_a_malformed_config_json(broken_checkpoint, monkeypatch, capsys):
    import anchorctx.evaluation.lm_eval.model as lm_eval_model

    def run(argv):  # lm-eval builds the model from --model_args first; no task is needed here
        lm_eval_model.AnchorctxLM(pretrained=str(broken_checkpoint), dtype="auto", device="cpu")

    monkeypatch.setattr(lm_eval_model, "main", run)
    args = ["--model", "anchorctx", "--model_args", f"pretrained={broken_checkpoint},dtype=auto"]
    assert main(["lm-eval", *args]) == 1
    err = _one_line(capsys, "lm-eval")
    file = broken_checkpoint / "config.json"
    assert f"{file}: not valid JSON (line 2 column 25: Expecting property name" in err, err
    assert "JSONDecodeError" not in err and "--debug" not in err


def test_every_model_config_reader_names_a_malformed_config_json(broken_checkpoint):
    from anchorctx.evaluation.generation import load_eval_model
    from anchorctx.models.loading import ModelFileError, build_hf_config
    from anchorctx.models.settings import ModelConfig

    where = rf"{broken_checkpoint}/config\.json: not valid JSON \(line 2 column 25"
    with pytest.raises(ModelFileError, match=where):
        build_hf_config(ModelConfig(path=broken_checkpoint), seq_len=None)
    with pytest.raises(ModelFileError, match=where):
        load_eval_model(broken_checkpoint, device="cpu", dtype="float32")
    (broken_checkpoint / "config.json").write_text("[]")
    with pytest.raises(ModelFileError, match=r"config\.json: expected a JSON object, found list"):
        build_hf_config(ModelConfig(path=broken_checkpoint), seq_len=None)


# -------------------------------------------------------------- row 11: `external` is reserved
def test_variant_external_is_reserved(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**MINIMAL, "run_root": str(tmp_path / "runs")}))
    assert main(["config", str(config), "--set", "variant=external"]) == 2
    err = _one_line(capsys, "config")
    assert "variant: 'external' is reserved" in err and "<run_root>/<name>/external" in err
    raw = {
        **MINIMAL,
        "run_root": str(tmp_path / "runs"),
        "variants": [{"name": "external", "attention": "anchor"}],
    }
    config.write_text(json.dumps(raw))
    assert main(["config", str(config)]) == 2
    assert "variants.0.name: 'external' is reserved" in _one_line(capsys, "config")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------- eval-worker against a server that is down
def test_eval_worker_names_the_server_it_cannot_reach(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import anchorctx.flows.pool as pool
    from anchorctx.process import free_port

    def execv(*_):  # the worker must never start
        raise AssertionError("the worker started")

    monkeypatch.setattr("os.execv", execv)
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    real = pool.register

    def register(*args):  # Prefect retries a refused connection for a while: once is enough
        monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "0")
        return real(*args)

    monkeypatch.setattr(pool, "register", register)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        assert main(["eval-worker", "gpus"]) == 1
    err = _one_line(capsys, "eval-worker")
    assert f"the Prefect server at {url} is unreachable (ConnectError" in err, err
    assert "PREFECT_API_URL" in err
