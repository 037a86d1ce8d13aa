"""The ``eslm`` dispatcher: what a user sees for a mistyped command, an override without '=', eslm's warnings
and a device the machine does not have."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides
from eslm.cli import main, one_line_warnings, split_config_items
from eslm.errors import ConfigError


def test_a_mistyped_command_gets_the_nearest_one(capsys):
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "unknown command 'trian'; did you mean 'eslm train'?" in err
    with pytest.raises(SystemExit):
        main(["export_hf"])
    assert "did you mean 'eslm export-hf'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("items,fix", [
    (["method.alpha", "0.2"], "fix: write method.alpha=0.2"),
    (["method.alpha:", "0.2"], "fix: write method.alpha=0.2"),
    (["method.alpha", "=", "0.2"], "fix: write method.alpha=0.2"),
    (["method.alpha", "=0.2"], "fix: write method.alpha=0.2"),
    (["method.alpha=", "0.2"], "fix: write method.alpha=0.2"),
    (["train.max_steps=3", "method.alpha"], "fix: write method.alpha=VALUE"),
])
def test_an_override_without_its_equals_sign_shows_the_fix(items, fix, capsys):
    with pytest.raises(ConfigError, match=fix):
        split_config_items(items)
    assert main(["train", *items, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fix in err and err.startswith("eslm train: error: expected ")


def test_files_and_overrides_still_split(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("train:\n  max_steps: 3\n")
    assert split_config_items([str(f), "method.alpha=0.2", "missing.yaml"]) == (
        [str(f), "missing.yaml"], ["method.alpha=0.2"])


def test_eslms_own_warnings_print_as_one_line(capsys):
    import warnings

    from eslm.config import build_config

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with one_line_warnings("eslm train"):
            build_config(overrides=["train.max_steps=5"])  # warmup (30) > max_steps
            warnings.warn("from elsewhere", UserWarning)  # not eslm's code: left to Python (here: to pytest)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("eslm train: warning: train.warmup_steps=30 exceeds train.max_steps=5")
    assert len(lines) == 1 and "from elsewhere" not in err


@pytest.mark.slow
def test_a_run_prints_no_raw_warning(tiny_data, tmp_path):
    """A warning a user can act on (warm-up longer than the run) is one line, without Python's source line; a
    validation domain smaller than asked is used whole without a warning (nothing to act on)."""
    over = tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 1, "train.warmup_steps": 2,
                                                  "eval.interval": 1, "eval.tokens_per_domain": 10**6})
    out = subprocess.run([sys.executable, "-m", "eslm.cli", "train", *over], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "eslm train: warning: train.warmup_steps=2 exceeds train.max_steps=1" in out.stderr, out.stderr
    assert "domain 'code' has" not in out.stderr, out.stderr
    assert "Warning:" not in out.stderr and "warnings.warn" not in out.stderr, out.stderr


def test_a_cuda_device_on_a_machine_without_one_is_one_line(tiny_data, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        assert main(["train", *tiny_overrides(tiny_data, tmp_path, **{"train.device": device})]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"eslm train: error: train.device={device}: expected a "
                                                       "CUDA device; found none"), err
    assert not (Path(tmp_path) / "t").exists()  # no run directory was made
