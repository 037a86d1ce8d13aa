"""metrics.py: the metric names are written and read through its constants only."""

import ast
from pathlib import Path

from eslm import metrics as M

SRC = Path(__file__).resolve().parents[1] / "src" / "eslm"
# names that are also ordinary words elsewhere (a checkpoint's "step", a data split "train", a state's "alpha")
ORDINARY = {M.STEP, M.KIND, M.KIND_TRAIN, M.KIND_EVAL, M.LR, M.ALPHA, M.THRESHOLD, M.CVAR, M.MFU}


def spelled_out(root: Path) -> list[str]:
    """Non-docstring string literals equal to a metric name (outside metrics.py), as 'file:line name'."""
    names = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str)} - ORDINARY
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "metrics.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        out += [f"{path.relative_to(root)}:{n.lineno} {n.value}" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
    return out


def test_metric_names_only_through_the_constants():
    assert spelled_out(SRC) == []


def test_the_check_sees_a_spelled_out_name(tmp_path):
    (tmp_path / "a.py").write_text('"""flops_paper in a docstring is prose."""\nx = {"flops_paper": 1, "step": 2}\n')
    assert spelled_out(tmp_path) == ["a.py:2 flops_paper"]
