"""A non-editable install (a wheel built from this tree) runs `eslm study demo` from any directory.

The package is installed with `pip install --no-deps --no-build-isolation .` into a temporary venv created
with `--without-pip`; its own site-packages (where eslm lands) comes first on its path, then the site-packages
of the interpreter running these tests (a `.pth` line each: torch, pip, setuptools and the other dependencies
come from the environment the user just installed, not from the base interpreter that venv was made from;
the editable eslm there stays invisible, as a `.pth` file is only read in a site directory). The wheel is
built by that environment's setuptools, which the `dev` extra requires new enough to build wheels on its own.
It is run from an empty directory with PYTHONPATH unset, so neither the checkout nor configs/ in the working
directory can help.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("install")
    src = base / "src-copy"  # build from a copy: the build leaves build/ and *.egg-info behind
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "src", "configs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, env=_env(), check=True).stdout.strip()
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (Path(own) / "_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "."],
                         cwd=src, capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return env_dir


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1"}


def _eslm(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "eslm"), *args], cwd=cwd, capture_output=True, text=True,
                          env=_env(), timeout=1800)


@pytest.mark.slow
def test_wheel_carries_configs_vocabulary_templates_and_py_typed(venv, tmp_path):
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import eslm, pathlib; print(eslm.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, env=_env())
    pkg = Path(out.stdout.strip()).parent
    assert pkg.is_relative_to(venv), f"eslm imported from {pkg}, not from the venv"
    assert (pkg / "py.typed").is_file()
    assert not (pkg / "configs").is_symlink()  # a real copy in the wheel
    shipped = {p.relative_to(pkg / "configs") for p in (pkg / "configs").rglob("*.yaml")}
    in_repo = {p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*.yaml")}
    assert shipped == in_repo and len(shipped) > 10
    assert {p.name for p in (pkg / "data" / "gpt2_bpe").iterdir()} >= {"encoder.json", "vocab.bpe", "LICENSE"}
    gpt2 = subprocess.run([str(venv / "bin" / "python"), "-c", "from eslm.data.tokenizers import get_tokenizer; "
                           "print(get_tokenizer('gpt2').encode('Hello world'))"],
                          cwd=tmp_path, capture_output=True, text=True, env=_env())
    assert gpt2.stdout.strip() == "[15496, 995]", gpt2.stderr[-2000:]
    # the report page's templates: every one in the repository, and the installed renderer finds them
    templates = ROOT / "src" / "eslm" / "analysis" / "report" / "templates"
    shipped = {p.name for p in (pkg / "analysis" / "report" / "templates").glob("*.j2")}
    assert shipped == {p.name for p in templates.glob("*.j2")} and "index.html.j2" in shipped
    page = subprocess.run([str(venv / "bin" / "python"), "-c", "import json, sys; from eslm.analysis.report import "
                           "render_html; d = json.load(open(sys.argv[1])); print(render_html(d['summary'], "
                           "d['written']), end='')", str(ROOT / "tests" / "analysis" / "report_pages" / "one-seed.json")],
                          cwd=tmp_path, capture_output=True, text=True, env=_env())
    expected = (ROOT / "tests" / "analysis" / "report_pages" / "one-seed.html").read_text(encoding="utf-8")
    assert page.returncode == 0 and page.stdout == expected, page.stderr[-2000:]


@pytest.mark.slow
def test_study_demo_runs_from_any_directory(venv, tiny_data, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    dry = _eslm(venv, ["study", "demo", "--dry-run", "--seeds", "1"], work)
    assert dry.returncode == 0 and " runs -> " in dry.stdout, dry.stderr[-2000:]
    planned = sorted(line.split(":")[0].strip() for line in dry.stdout.splitlines() if line.startswith("  "))
    assert len(planned) == 3, dry.stdout  # the demo's three methods, one seed
    tiny = [o for o in tiny_overrides(tiny_data, work / "runs") if not o.startswith(("run.", "train.max_steps"))]
    res = _eslm(venv, ["study", "demo", "--seeds", "1", "--out", str(work / "runs"), *tiny, "train.max_steps=1",
                       "eval.interval=1", "eval.tokens_per_domain=128", "log.interval=1"], work)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = sorted(p.name for p in (work / "runs" / "demo").iterdir() if (p / "result.json").is_file())
    assert runs == planned
    cfg = _eslm(venv, ["train", "configs/paper/base.yaml", "configs/paper/124m.yaml", "--print-config"], work)
    assert cfg.returncode == 0 and "preset: gpt2-124m" in cfg.stdout, cfg.stderr[-2000:]


def _lowest_versions():
    """The module .ci/lowest_versions.py (CI's lowest-versions check reads its pins from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lowest_versions", ROOT / ".ci" / "lowest_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lowest_versions_pin_every_direct_dependency_at_its_bound(tmp_path):
    import re

    lv = _lowest_versions()
    text = lv.constraints(["train", "plot", "dev"])
    pins = dict(line.split("==") for line in text.splitlines() if not line.startswith("#"))
    not_pinned = re.findall(r"^# (\S+?)>=\S+ not pinned: \S", text, flags=re.M)
    assert pins["tiktoken"] == "0.8" and pins["numpy"] == "1.24" and pins["matplotlib"] == "3.7"
    assert not_pinned == ["torch", "setuptools"]  # each with its reason
    deps = (ROOT / "pyproject.toml").read_text()
    core = deps.split("dependencies = [", 1)[1].split("]", 1)[0] + deps.split("train = [", 1)[1].split("]", 1)[0]
    named = {lv._name(n) for n in re.findall(r'"([A-Za-z0-9._-]+)', core)} | {"matplotlib", "pytest", "hypothesis",
                                                                               "setuptools", "build", "twine",
                                                                               "mypy", "ruff"}
    assert set(pins) | set(not_pinned) == named
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\ndependencies = ["torch>=2.6", "numpy"]\n[project.optional-dependencies]\n'
                   'dev = ["pytest>=7", "Py_Yaml>=6.0; python_version >= \'3\'"]\n')
    with pytest.raises(SystemExit, match=r"expected a lower bound \(>=\) on every direct dependency; found 'numpy'"):
        lv.direct_requirements([], bad)
    bad.write_text(bad.read_text().replace('"numpy"', '"numpy>=1.24,<3"'))
    assert lv.direct_requirements(["dev"], bad) == {"torch": "2.6", "numpy": "1.24", "pytest": "7", "py-yaml": "6.0"}
    with pytest.raises(SystemExit, match="expected extras among dev; found"):
        lv.direct_requirements(["gpu"], bad)


# Top-level modules of the optional extras (pyproject.toml's [project.optional-dependencies]): a core install
# has none of them.
OPTIONAL_MODULES = ("datasets", "pyarrow", "transformers", "accelerate", "lm_eval", "matplotlib", "tensorboard",
                    "wandb", "pytest", "hypothesis", "trl", "pytorch_lightning", "lightning", "build", "twine")

BLOCKER = '''
import importlib.abc, sys
class _CoreOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (optional: not in a core install)", name=name)
        return None
sys.meta_path.insert(0, _CoreOnly())
'''


@pytest.mark.slow
def test_sdist_and_wheel_pass_twine_check_and_run_with_core_dependencies_only(tmp_path):
    """python -m build makes an sdist and a wheel (the wheel built from the sdist) that pass twine check
    --strict; the wheel, installed in a fresh venv outside the repository in which every optional extra's
    module fails to import, runs `eslm study demo --dry-run` and imports eslm.api and eslm.integrations."""
    pytest.importorskip("build")
    pytest.importorskip("twine")
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "src", "configs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    wheel, sdist = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheel) == 1 and len(sdist) == 1
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheel + sdist)],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0 and out.stdout.count("PASSED") == 2, out.stdout[-2000:] + out.stderr[-2000:]

    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    own = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                              capture_output=True, text=True, env=_env(), check=True).stdout.strip())
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (own / "_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))
    (own / "_core_only.py").write_text(BLOCKER.format(names=set(OPTIONAL_MODULES)))
    (own / "_core_only.pth").write_text("import _core_only\n")
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel[0])],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    blocked = subprocess.run([str(py), "-c", "import transformers"], cwd=work, capture_output=True, text=True,
                             env=_env())
    assert blocked.returncode != 0 and "not in a core install" in blocked.stderr  # the blocker works
    imp = subprocess.run([str(py), "-c", "import eslm, eslm.api, eslm.integrations, eslm.integrations.torchtitan; "
                          "print(eslm.__file__)"], cwd=work, capture_output=True, text=True, env=_env())
    assert imp.returncode == 0, imp.stderr[-2000:]
    assert Path(imp.stdout.strip()).is_relative_to(env_dir)
    dry = _eslm(env_dir, ["study", "demo", "--dry-run", "--seeds", "1"], work)
    assert dry.returncode == 0 and " runs -> " in dry.stdout, dry.stdout[-2000:] + dry.stderr[-2000:]
