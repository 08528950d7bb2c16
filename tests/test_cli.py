"""Every subcommand has --help; config errors exit 2 with the message on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

from anchorctx.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert command in out and COMMANDS[command].help.split()[0] in out


def test_config_command_prints_resolved_config(capsys):
    assert main(["config", "configs/demo.yaml", "--set", "training.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "run directory: runs/demo/anchor" in out


def test_config_error_exits_2(capsys):
    assert main(["config", "configs/demo.yaml", "--set", "training.stepz=7"]) == 2
    assert "unknown key 'training.stepz'" in capsys.readouterr().err


def test_help_imports_no_heavy_package():
    """`anchorctx --help` (and every subcommand's) stays fast: torch, transformers, Prefect and
    DeepSpeed load only in the commands that use them (a fresh interpreter: pytest has them)."""
    heavy = ("torch", "transformers", "prefect", "deepspeed")
    code = (
        "import sys\n"
        "from anchorctx.cli import COMMANDS, main\n"
        "for argv in [['--help'], *([c, '--help'] for c in COMMANDS)]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_config_command_imports_no_heavy_package():
    """`anchorctx config` (the config checks every command runs first) loads no torch,
    transformers or datasets."""
    heavy = ("torch", "transformers", "datasets", "prefect", "deepspeed")
    code = (
        "import sys\n"
        "from anchorctx.cli import main\n"
        "assert main(['config', 'configs/demo.yaml', '--arms']) == 0\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_lm_eval_passes_its_command_line_on_verbatim(monkeypatch):
    """lm-eval's own options (``--model``, ``--help``) reach lm-eval, not anchorctx's parser."""
    from anchorctx.evaluation.lm_eval import model as lm_eval_model

    seen: list[list[str]] = []
    monkeypatch.setattr(lm_eval_model, "main", lambda argv: seen.append(list(argv)))
    line = ["--model", "anchorctx", "--model_args", "pretrained=DIR", "--tasks", "ruler", "-h"]
    assert main(["--debug", "lm-eval", *line]) == 0
    assert seen == [line]
