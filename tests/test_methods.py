"""The registry (``eslm.methods``) is the one source of what a method is: each line's role, control and needs are
consistent, and the report and the study read them instead of method names."""

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from eslm import methods
from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.errors import ConfigError
from eslm.methods import METHODS, ROLES, MethodSpec
from eslm.model.gpt import GPT, preset
from eslm.selection.selectors import VaRSelector
from eslm.train.step import StepOptions, forward_backward


def test_one_baseline_and_every_control_is_a_registered_control():
    assert [n for n, s in METHODS.items() if s.role == "baseline"] == [methods.baseline()]
    for name, spec in METHODS.items():
        assert spec.role in ROLES, name
        if spec.control:
            assert METHODS[spec.control].role == "control", f"{name}: control {spec.control!r} is not a control"
        if spec.role == "method":
            assert spec.control, f"{name}: a method names the control it must beat"


def test_register_refuses_a_second_baseline_and_an_unknown_role():
    with pytest.raises(TypeError, match="already the baseline"):
        methods.register(MethodSpec("clm2", "h", lambda ctx: None, role="baseline"))
    with pytest.raises(TypeError, match="role 'baseline-ish'"):
        methods.register(MethodSpec("x", "h", lambda ctx: None, role="baseline-ish"))
    assert "clm2" not in METHODS and "x" not in METHODS


@pytest.mark.parametrize("name", [n for n, s in METHODS.items() if s.frozen_models])
def test_a_needed_model_is_a_required_key(name):
    for need in METHODS[name].frozen_models:
        with pytest.raises(ConfigError, match=rf"{need.key}: {name} needs {need.words}; set {need.key}=RUN_DIR"):
            build_config(overrides=[f"method.name={name}"])


def test_the_report_takes_the_baseline_and_controls_from_the_registry(monkeypatch):
    # a registry where "random" is the baseline and "clm" the control of eslm-entropy: the report follows it
    from eslm.analysis.report import summary
    from eslm.analysis.rundir import Group

    swapped = dict(METHODS)
    swapped["clm"] = dataclasses.replace(METHODS["clm"], role="control")
    swapped["random"] = dataclasses.replace(METHODS["random"], role="baseline")
    swapped["eslm-entropy"] = dataclasses.replace(METHODS["eslm-entropy"], control="clm")
    monkeypatch.setattr(methods, "METHODS", swapped)

    def group(method):
        run = type("R", (), {"config": {"method": {"name": method, "alpha": 0.2}}, "name": f"{method}-s1",
                             "seed": 1, "eval": [{"step": 10, "val_loss": 4.0}]})()
        return Group(key=method, label=method, method=method, settings={}, runs=[run])

    groups = [group("clm"), group("random"), group("eslm-entropy")]
    base, why = summary.find_baseline(groups, None)
    assert why is None and base.method == "random"
    assert summary._control_for(groups[2], groups).method == "clm"
    assert summary._control_for(groups[1], groups) is None
    # the spread across seeds: each group against the baseline and its own control, found by role
    against = {row["label"]: set(row["against"]) for row in summary.spread(groups)}
    assert against == {"clm": {"random"}, "random": set(), "eslm-entropy": {"random", "clm"}}


class _GapSelector(VaRSelector):
    """A new rule under a new score name: keep the tokens whose loss most exceeds their entropy (surprise beyond
    the model's own uncertainty). Its score is its own, formed from two statistics it names in ``needs``."""

    seen: list = []

    def __init__(self, ctx: methods.BuildContext):
        super().__init__("surprise_gap", ctx.method.alpha, n_domains=ctx.n_domains, needs=("loss", "entropy"))

    def scores(self, stats, batch):
        self.seen.append(stats.entropy)
        return (stats.loss - stats.entropy).view(batch.x.shape)


def test_a_new_selector_gets_the_statistics_it_declares(monkeypatch):
    # one module (the selector above) and one registry line: the scoring pass fills stats.entropy for it, whatever
    # its score is called; no method or score name decides what the step computes
    monkeypatch.setitem(METHODS, "gap", MethodSpec(
        "gap", "keep the tokens by loss - entropy",
        lambda ctx: methods.Method("gap", tokens=_GapSelector(ctx), objective=methods.CrossEntropy()),
        control="random"))
    cfg = build_config(overrides=["method.name=gap", "method.alpha=0.25"])
    method = methods.build_method(method_context(cfg, device=torch.device("cpu"), n_domains=2))
    assert method.needs_entropy and method.tokens.score == "surprise_gap"
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64))
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = Batch(x, x.roll(-1, 1), torch.arange(4) % 2)
    _GapSelector.seen.clear()
    result = forward_backward(model, model, method, [batch], StepOptions(accum_steps=1), step=1, lr=1e-3)
    assert len(_GapSelector.seen) == 1 and _GapSelector.seen[0] is not None
    assert _GapSelector.seen[0].shape == (64,) and bool((_GapSelector.seen[0] >= 0).all())
    assert result.tokens_kept == 64 - 16


def test_a_selector_that_needs_no_known_statistic_is_refused():
    with pytest.raises(TypeError, match=r"needs \('surprise_gap',\); expected statistics of the scoring pass among "
                                        r"loss, entropy, lse"):
        VaRSelector("surprise_gap", 0.1)


SRC = Path(methods.__file__).resolve().parent


def method_name_literals(root: Path) -> list[str]:
    """"path:line 'name'" for every string constant in the package that is a registered method's name, outside the
    registry (``eslm/methods.py``): the rest of the package finds a method by its registry line (``baseline``,
    ``control_of``, ``role_of``, ``MethodSpec`` fields), never by its name. Docstrings do not count, nor a
    registered config section's ``key`` in the module that defines the section (``method.rho1.*`` is a config
    namespace that happens to share Rho-1's name)."""
    sections = {(Path(sys.modules[cls.__module__].__file__).resolve(), cls.key)
                for spec in METHODS.values() for cls in spec.settings}
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == Path(methods.__file__).resolve():
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in METHODS
                    and id(node) not in docstrings and (path.resolve(), node.value) not in sections):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.value!r}")
    return out


def test_no_method_name_literal_outside_the_registry():
    assert method_name_literals(SRC) == [], "find the method by its registry line (eslm.methods: baseline, ...)"


def test_the_literal_scan_sees_a_planted_name(tmp_path):
    (tmp_path / "eslm").mkdir()
    (tmp_path / "eslm" / "report.py").write_text('"""Compares with clm."""\nBASE = "clm"\nrefs = ["random", x]\n')
    assert method_name_literals(tmp_path / "eslm") == ["eslm/report.py:2 'clm'", "eslm/report.py:3 'random'"]
