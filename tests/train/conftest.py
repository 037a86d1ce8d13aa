"""Fixtures of the run-directory tests (reliability, ownership, integrity): a finished run trained with the test
module's ``BASE`` overrides (once per module), and a fresh copy of it for each test that changes it."""

import shutil

import pytest

from conftest import tiny_overrides


@pytest.fixture(scope="module")
def base_run(tiny_data, tmp_path_factory, request):
    from eslm.config import build_config
    from eslm.train.trainer import train

    out = tmp_path_factory.mktemp("base")
    train(build_config(overrides=tiny_overrides(tiny_data, out, **request.module.BASE)))
    return out / "t"


@pytest.fixture
def run_copy(base_run, tmp_path):
    shutil.copytree(base_run, tmp_path / "t", symlinks=True)
    return tmp_path / "t"
