"""The tests mirror the package: ``tests/<pkg>/test_<module>.py`` tests ``src/eslm/<pkg>/``, a top-level
``tests/test_<name>.py`` tests the top-level module ``src/eslm/<name>.py`` — or is one of the whole-project
checks listed here (documentation, install, layering, GPU suite and window, benchmarks)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "eslm"

WHOLE_PROJECT = {"test_docs_commands", "test_readme", "test_paper_doc", "test_install", "test_layers",
                 "test_layout", "test_gpu", "test_gpu_suite", "test_gpu_window", "test_benchmarks", "test_refactor_guard"}


def misplaced(tests: Path, src: Path) -> list[str]:
    out = []
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests)
        if len(rel.parts) == 1:
            if f.stem not in WHOLE_PROJECT and not (src / f"{f.stem[5:]}.py").is_file():
                out.append(f"{rel}: no module src/eslm/{f.stem[5:]}.py (move it to tests/<package>/)")
        elif not (src / rel.parts[0] / "__init__.py").is_file():
            out.append(f"{rel}: no package src/eslm/{rel.parts[0]}/")
        elif not (f.parent / "__init__.py").is_file():
            out.append(f"{rel}: {f.parent.name}/ needs an __init__.py (equal test basenames must not clash)")
    return out


def test_tests_mirror_the_package():
    assert misplaced(TESTS, SRC) == []


def test_the_check_catches_a_misplaced_test(tmp_path):
    (tmp_path / "src" / "risky").mkdir(parents=True)
    (tmp_path / "src" / "risky" / "__init__.py").write_text("")
    (tmp_path / "tests" / "risky").mkdir(parents=True)
    (tmp_path / "tests" / "risky" / "test_x.py").write_text("")
    (tmp_path / "tests" / "test_selectors.py").write_text("")
    assert misplaced(tmp_path / "tests", tmp_path / "src") == [
        "risky/test_x.py: risky/ needs an __init__.py (equal test basenames must not clash)",
        "test_selectors.py: no module src/eslm/selectors.py (move it to tests/<package>/)"]
