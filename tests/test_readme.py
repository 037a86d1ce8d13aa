"""README.md stays true: the test command is CI's, the paths it points to exist, the methods are the registry's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_steps(ci_script: str) -> list[str]:
    """The commands ``.ci/run`` runs as the README's (its ``readme_step '...'`` lines)."""
    return re.findall(r"^readme_step '([^']+)'$", ci_script, flags=re.M)


def test_ci_runs_the_readme_commands():
    steps = readme_steps((ROOT / ".ci" / "run").read_text())
    assert steps[0].startswith("python3 -m venv ") and any("python -m pytest" in s for s in steps)
    lines = README.splitlines()
    missing = [s for s in steps if s not in lines]
    assert not missing, missing
    block = README.split("Run the tests:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == steps  # the README's test block is exactly what CI runs, nothing more


def test_readme_steps_reads_the_ci_script():
    script = "readme_step 'python3 -m venv .venv'\n  readme_step 'indented'\necho 'readme_step x'\n"
    assert readme_steps(script) == ["python3 -m venv .venv"]


def test_every_path_in_the_readme_exists():
    paths = set(re.findall(r"`((?:src|configs|docs|tests|benchmarks|examples|constraints)/[^`\s]*)`", README))
    paths |= set(re.findall(r"\]\(((?:docs|benchmarks)/[^)]+)\)", README))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p.split("#")[0]).exists())
    assert not missing, missing


def where_do_i_change(markdown: str) -> list[tuple[str, list[str]]]:
    """(task, paths) of each row of a markdown's "## Where do I change ..." table."""
    section = markdown.split("## Where do I change ...", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| to ...")]
    return [(row.split(" | ")[0].strip("| "),
             re.findall(r"`((?:src|configs|docs|tests|benchmarks|examples)/[^`\s]*|README\.md)`", row))
            for row in rows]


def test_one_where_do_i_change_table_and_every_file_it_names_exists():
    # docs/architecture.md holds the one table; README.md links to it instead of keeping its own
    arch = (ROOT / "docs" / "architecture.md").read_text()
    rows = where_do_i_change(arch)
    tasks = " ".join(task for task, _ in rows)
    for task in ("selection rule", "add a method with one setting", "add a metric", "add a report figure",
                 "data mixture", "FLOPs accounting", "baseline"):
        assert task in tasks, task
    assert all(paths for _, paths in rows), [task for task, paths in rows if not paths]
    missing = sorted({p for _, paths in rows for p in paths if not (ROOT / p.replace("<command>", "train")).exists()})
    assert not missing, missing
    assert "docs/architecture.md#where-do-i-change-" in README
    assert not where_do_i_change(README) and "| what | file |" not in README


def test_methods_table_matches_the_registry():
    from eslm.methods import describe_methods

    registry = {line.split()[0] for line in describe_methods().splitlines() if line.strip()}
    section = README.split("## Methods", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    listed = {name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}
    assert listed == registry


def test_the_readme_drop_in_snippet_runs_and_keeps_the_top_tokens_by_entropy():
    """The three lines near the README's top, run as written on a small random head (no download)."""
    import torch

    code = README.split("```python\n", 1)[1].split("```", 1)[0]
    assert "selective_loss" in code and len(code.strip().splitlines()) == 3
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(4, 10, 16, requires_grad=True)
    targets = torch.randint(0, 50, (4, 10))
    ns = {"targets": targets, "h": h, "lm_head": lm_head}
    exec(code, ns)
    assert ns["stats"].num_kept.item() == 40 - int(0.2 * 40)  # alpha 0.2: the top 80% of the 40 tokens
    grad_rows = (h.grad.abs().sum(-1) > 0).sum().item()
    assert grad_rows == ns["stats"].num_kept.item()  # the dropped tokens get no gradient
