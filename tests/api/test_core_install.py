"""The drop-in core: `pip install eslm` (torch and numpy) gives eslm.api; the trainer's dependencies are the
train extra, named in one line when a command needs them; the metadata's license is an SPDX string; logging
extras are off by default where they are not installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TRAIN_MODULES = ("yaml", "tiktoken", "tiktoken_ext", "tqdm", "safetensors", "jinja2", "scipy")

# a finder that makes the train extra's modules (and every other optional one) missing, as in a core install
BLOCK = '''
import importlib.abc, sys
class _CoreOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _CoreOnly())
'''


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()


def test_core_requires_torch_and_numpy_only_and_train_is_in_all():
    project = _project()
    assert sorted(_name(r) for r in project["dependencies"]) == ["numpy", "torch"]
    extras = project["optional-dependencies"]
    assert sorted(_name(r) for r in extras["train"]) == ["jinja2", "pyyaml", "safetensors", "scipy", "tiktoken",
                                                                  "tqdm"]
    assert "train" in re.search(r"\[(.*)\]", extras["all"][0]).group(1).split(",")
    assert project["license"] == "MIT"  # the SPDX string (the table form is deprecated by setuptools)


def _run(code: str, blocked=TRAIN_MODULES) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", BLOCK.format(names=set(blocked)) + code], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


def test_selective_loss_runs_without_the_train_extra():
    out = _run("import torch\nfrom eslm.api import selective_loss, AdaAlpha, patch_model\n"
               "t = torch.randint(0, 11, (2, 8)); loss, st = selective_loss(t, logits=torch.randn(2, 8, 11), "
               "alpha=0.25)\nprint(int(st.num_kept), sorted(m for m in sys.modules if m.split('.')[0] in "
               f"{set(TRAIN_MODULES)!r}))")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["12", "[]"]


def test_a_command_without_the_train_extra_names_it_in_one_line():
    out = _run("import sys\nfrom eslm.cli import main\nsys.argv = ['eslm', 'train', 'configs/paper/124m.yaml']\n"
               "sys.exit(main(sys.argv[1:]))")
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-2000:]
    assert "eslm[train]" in lines[0] and "Traceback" not in out.stderr


def test_tensorboard_is_off_by_default_where_it_is_not_installed():
    code = ("import sys\nsys.modules['tensorboard'] = None\nfrom eslm.config import LogSection\n"
            "print(LogSection().tensorboard)")
    assert _run(code, blocked=()).stdout.strip() == "False"
    installed = _run("import importlib.util\nfrom eslm.config import LogSection\n"
                     "print(LogSection().tensorboard == (importlib.util.find_spec('tensorboard') is not None))",
                     blocked=())
    assert installed.stdout.strip() == "True", installed.stderr[-2000:]
