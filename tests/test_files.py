"""eslm/files.py: names that stay one path component (issue 24 item 4)."""

import pytest

from eslm.config import build_config
from eslm.errors import ConfigError
from eslm.files import check_name, name_problem

BAD = ["", ".", "..", "../x", "a/b", "/abs", "a\\b", "x\x00y", "line\nbreak", ".hidden", "-opt", " pad", "pad ",
       "x" * 201]
GOOD = ["t", "eslm-loss-alpha0.3-s2", "clm_small.s1", "Run+1", "x" * 200, "café"]


@pytest.mark.parametrize("name", BAD)
def test_unsafe_names_are_refused_in_one_line(name):
    problem = name_problem(name, "run.name")
    assert problem and problem.startswith("run.name: expected a single path-safe name") and "\n" not in problem
    with pytest.raises(ConfigError):
        check_name(name, "run.name")


@pytest.mark.parametrize("name", GOOD)
def test_safe_names_pass(name):
    assert name_problem(name, "label") is None and check_name(name, "label") == name


def test_non_strings_are_refused():
    assert "got int 5" in name_problem(5, "label")


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", ".", "a/b"])
def test_run_name_is_validated_before_anything_runs(name):
    with pytest.raises(ConfigError, match="run.name: expected a single path-safe name"):
        build_config(overrides=[f"run.name={name}"])


def test_an_empty_run_name_means_the_default():
    assert build_config(overrides=["run.name="]).run.name == ""
