"""The registry (``eslm.methods``) is the one source of what a method is: each line's role, control and needs are
consistent, and the report and the study read them instead of method names."""

import dataclasses

import pytest

from eslm import methods
from eslm.config import build_config
from eslm.errors import ConfigError
from eslm.methods import METHODS, ROLES, MethodSpec


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
                             "seed": 1})()
        return Group(key=method, label=method, method=method, settings={}, runs=[run])

    groups = [group("clm"), group("random"), group("eslm-entropy")]
    base, why = summary.find_baseline(groups, None)
    assert why is None and base.method == "random"
    assert summary._control_for(groups[2], groups).method == "clm"
    assert summary._control_for(groups[1], groups) is None
