"""The refactor guard's comparison (benchmarks/refactor_losses.py): one ulp, a missing key or record is a difference."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _guard():
    spec = importlib.util.spec_from_file_location("refactor_losses", ROOT / "benchmarks" / "refactor_losses.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_differences_are_bit_exact():
    g = _guard()
    run = {"train": [{"train_loss": 1.0, "kept_frac": 0.75}], "eval": [{"val_loss": 2.0}]}
    assert g.differences({"a": run}, {"a": run}) == []
    one_ulp = {"train": [{"train_loss": 1.0000000000000002, "kept_frac": 0.75}], "eval": [{"val_loss": 2.0}]}
    assert g.differences({"a": run}, {"a": one_ulp}) == ["a/train[0]/train_loss: 1.0 -> 1.0000000000000002"]
    assert g.differences({"a": run}, {"a": {**run, "eval": []}}) == ["a/eval: 1 records in the baseline, 0 now"]
    assert g.differences({"a": run}, {}) == ["a: missing now"]
    no_key = {"train": [{"train_loss": 1.0}], "eval": [{"val_loss": 2.0}]}
    assert g.differences({"a": run}, {"a": no_key}) == ["a/train[0]/kept_frac: 0.75 -> '<absent>'"]
    nan = {"train": [{"train_loss": float("nan")}], "eval": []}
    assert g.differences({"a": nan}, {"a": nan}) == []
