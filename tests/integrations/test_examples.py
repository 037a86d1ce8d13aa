"""The examples run as documented, on tiny models, offline."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_hf_trainer_example(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    last = load("hf_trainer_eslm").main(["--steps", "3", "--ada", "--output-dir", str(tmp_path)])
    assert last["step"] == 3 and 0.8 < last["eslm/kept_frac"] <= 1.0
    assert "eval_loss (plain CE)" in capsys.readouterr().out
