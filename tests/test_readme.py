"""README.md stays true: the test command is CI's, the paths it points to exist, the methods are the registry's."""

from __future__ import annotations

import json
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


# ---------------------------------------------------------------------------------------------------------
# The scorecard's step counts and per-step cost ratios, recomputed from the committed summaries
# (docs/results/<study>-summary.json, written by eslm report): a README number that is not the summary's fails.
# ---------------------------------------------------------------------------------------------------------


def _summary(study: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / f"{study}-summary.json").read_text())


def _groups(study: str) -> dict:
    summary = _summary(study)
    return {g["label"]: g for g in summary["groups"]}


def _steps(g: dict) -> int:
    s = g["final_step"]
    assert s["min"] == s["max"], f"{g['label']}: runs of one group stopped at different steps"
    return int(s["mean"])


def _cpu_per_step(g: dict, clm: dict) -> float:
    """A group's training CPU seconds per step over CLM's (means over seeds)."""
    return (g["final_cpu_s"]["mean"] / g["final_step"]["mean"]) / (clm["final_cpu_s"]["mean"] / clm["final_step"]["mean"])


def _ratios(g: dict, clm: dict, names, digits: int = 2) -> str:
    """ "NAME r.rrx, ..." of each (name, group label): its CPU per step over CLM's."""
    return ", ".join(f"{name} {_cpu_per_step(g[label], clm):.{digits}f}x" for name, label in names)


def _tokens_k(*groups: dict) -> str:
    lo = min(g["final_tokens_seen"]["min"] for g in groups)
    hi = max(g["final_tokens_seen"]["max"] for g in groups)
    return f"{lo / 1000:.0f}-{hi / 1000:.0f}k tokens"


def _rho1_vs_random_at(study: str, step: int) -> str:
    """ "m [lo, hi] at step N": Rho-1 - random at one evaluation, from the summary's differences over training."""
    over = _summary(study)["differences_over_training"]
    e = next(e for e in over["control"] if e["label"] == "rho1" and e["against"] == "random")
    i = e["step"].index(step)
    return f"{e['mean'][i]:+.3f} [{e['lo'][i]:+.3f}, {e['hi'][i]:+.3f}] at step {step}"


KD_ARMS = (("dense-KD", "dense-kd"), ("ESLM-KD", "eslm-kd-entropy"), ("random-KD", "random-kd"), ("SALT", "salt"))


def scorecard_claims() -> list[tuple[str, str]]:
    """(study, the README text its summary gives) for each step count and per-step cost ratio the README states."""
    out = []
    g = _groups("rho1-cpu")
    c = g["clm"]
    out += [("rho1-cpu", f"Rho-1 trains {_steps(g['rho1'])} steps to CLM's {_steps(c)} and the dropping arms' {_steps(g['random'])}"),
            ("rho1-cpu", f"{_cpu_per_step(g['rho1'], c):.2f}x CLM's CPU per step\n"
                         f"({g['rho1']['step_cost_vs_clm']['mean']:.2f}x its executed FLOPs"),
            ("rho1-cpu", f"at equal steps Rho-1 leads random dropping ({_rho1_vs_random_at('rho1-cpu', 108)})")]
    g = _groups("rho1-fair-cpu")
    c = g["clm"]
    out += [("rho1-fair-cpu", f"CPU per step vs CLM (AMD EPYC family 25 model 1): Rho-1 {_cpu_per_step(g['rho1'], c):.2f}x, "
                              f"ESLM-loss {_cpu_per_step(g['eslm-loss'], c):.2f}x (executed FLOPs per step "
                              f"{g['rho1']['step_cost_vs_clm']['mean']:.2f}x, {g['eslm-loss']['step_cost_vs_clm']['mean']:.2f}x)"),
            ("rho1-fair-cpu", f"Rho-1 {_steps(g['rho1'])} steps, the others {_steps(c)}-{_steps(g['random'])}"
             if _steps(g["random"]) == _steps(g["eslm-loss"]) else "steps mismatch"),
            ("rho1-fair-cpu", f"Rho-1 {_cpu_per_step(g['rho1'], c):.2f}x, ESLM-loss {_cpu_per_step(g['eslm-loss'], c):.2f}x, "
                              f"random {_cpu_per_step(g['random'], c):.2f}x"),
            ("rho1-fair-cpu", f"level with random dropping ({_rho1_vs_random_at('rho1-fair-cpu', 108)})")]
    r, g = g, _groups("rho1-fair-steps-cpu")
    c = g["clm"]
    primary = _summary("rho1-fair-steps-cpu")["primary"]
    d = primary["losses"]["final validation loss"]
    rho1 = f"{_cpu_per_step(g['rho1'], c):.2f}x CLM's CPU per step"
    out += [("rho1-fair-steps-cpu", f"Rho-1 {_cpu_per_step(r['rho1'], r['clm']):.2f}x and {rho1} (AMD EPYC)"),
            ("rho1-fair-steps-cpu", f"({rho1}, AMD EPYC family 25 model 17)"),
            ("rho1-fair-steps-cpu", "CPU per step against CLM's (means over seeds): " + _ratios(
                g, c, (("Rho-1", "rho1"), ("ESLM-loss", "eslm-loss"), ("random", "random")))),
            ("rho1-fair-steps-cpu", f"every run takes CLM's {_steps(c)} steps of 4 x 128 tokens"
             if {_steps(x) for x in g.values()} == {270} else "steps mismatch"),
            ("rho1-fair-steps-cpu", f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] nats (p = {d['p']:.2f}; MDE {d['mde']:.3f}"
             if primary["group"] == "eslm-loss" and primary["against"] == "rho1" else "not the primary")]
    g = _groups("distill-cpu")
    c = g["clm"]
    out += [("distill-cpu", f"180 steps, dense-KD {_steps(g['dense-kd'])}, ESLM-KD and random-KD "
                            f"{_steps(g['eslm-kd-entropy'])}, SALT {_steps(g['salt'])})"
             if _steps(c) == 180 and _steps(g["eslm-kd-entropy"]) == _steps(g["random-kd"]) else "steps mismatch"),
            ("distill-cpu", _tokens_k(*g.values())),
            ("distill-cpu", f"({_ratios(g, c, KD_ARMS)})")]
    g = _groups("greats-pilot-cpu")
    c = g["clm"]
    out += [("greats-pilot-cpu", f"CPU per step **{_cpu_per_step(g['greats'], c):.2f}x CLM's**"),
            ("greats-pilot-cpu", f"a step cost {g['greats']['step_cost_vs_clm']['mean']:.2f}x CLM's paper-FLOPs, so at "
                                 f"CLM's budget it trains {_steps(g['greats'])} steps to CLM's {_steps(c)}"),
            ("greats-pilot-cpu", f"a run costs {g['greats']['final_cpu_s']['mean'] / c['final_cpu_s']['mean']:.2f}x "
                                 "CLM's CPU")]
    g = _groups("bridge-cpu")
    c = g["clm"]
    arms = [g[k] for k in ("eslm-entropy", "eslm-loss", "random")]
    out += [("bridge-cpu", f"(CLM {_steps(c)} steps of 8 x 288; the dropping arms {_steps(arms[0])} steps"
             if len({_steps(x) for x in arms}) == 1 else "steps mismatch"),
            ("bridge-cpu", "CPU per step against CLM's (means over seeds): " + _ratios(
                g, c, (("ESLM-entropy", "eslm-entropy"), ("ESLM-loss", "eslm-loss"), ("random", "random")), 3))]
    g = _groups("distill-byte-equal-cpu")
    c = g["clm"]
    out += [("distill-byte-equal-cpu", f"CLM {_steps(c)} steps, dense-KD {_steps(g['dense-kd'])}, ESLM-KD and random-KD "
                                       f"{_steps(g['eslm-kd-entropy'])}, SALT {_steps(g['salt'])}"
             if _steps(g["eslm-kd-entropy"]) == _steps(g["random-kd"]) else "steps mismatch"),
            ("distill-byte-equal-cpu", "CPU per step against CLM's (means over seeds): " + _ratios(g, c, KD_ARMS))]
    g = _groups("batch-cpu")
    c = g["clm"]
    out += [("batch-cpu", f"CLM at 6 per step ({_steps(c)} steps), ESLM-entropy and random dropping at\n7 "
                          f"({_steps(g['eslm-entropy'])} steps" if _steps(g["eslm-entropy"]) == _steps(g["random"])
             else "steps mismatch"),
            ("batch-cpu", f"A step at 7 sequences costs {_cpu_per_step(g['eslm-entropy'], c):.2f}x CLM's CPU at 6 for "
                          f"ESLM-entropy and {_cpu_per_step(g['random'], c):.2f}x for random")]
    g = _groups("ada-cpu")
    out += [("ada-cpu", f"(CLM {_steps(g['clm'])} steps, ESLM and random {_steps(g['eslm-entropy'])}, Ada "
                        f"{_steps(g['ada-eslm-entropy'])})")]
    g = _groups("alpha-cpu")
    c = g["clm"]
    ent = [g[f"eslm-entropy (method.alpha={a})"] for a in (0.1, 0.3, 0.5)]
    rnd = [g[f"random (method.alpha={a})"] for a in (0.1, 0.3, 0.5)]
    out += [("alpha-cpu", f"({_steps(c)} CLM steps; " + " / ".join(str(_steps(x)) for x in ent)
             + " steps for the dropping arms)" if [_steps(x) for x in ent] == [_steps(x) for x in rnd] else "mismatch"),
            ("alpha-cpu", "ESLM-entropy " + " / ".join(f"{_cpu_per_step(x, c):.3f}" for x in ent) + ", random "
             + " / ".join(f"{_cpu_per_step(x, c):.3f}" for x in rnd))]
    g = _groups("confirm-cpu")
    out += [("confirm-cpu", f"alpha 0.2, {_tokens_k(*g.values()).replace(' tokens', '')} tokens, 20 seeds")]
    return out


def test_scorecard_step_counts_and_cost_ratios_come_from_the_summaries():
    detail = (ROOT / "docs" / "results.md").read_text()  # the README's scorecard in full, and each study's paragraph
    text = " ".join((README + "\n" + detail).split())  # line breaks inside a sentence do not matter
    missing = [(study, claim) for study, claim in scorecard_claims() if " ".join(claim.split()) not in text]
    assert missing == []


def test_the_scorecard_verdicts_are_short_and_every_row_links_its_results():
    """A newcomer reads the README's scorecard in a minute: each verdict cell at most 30 words, the details on the
    docs/results pages it links (docs/results.md holds the full table)."""
    rows = [r for r in README.split("**Scorecard:", 1)[1].split("\n") if r.startswith("| ") and "---" not in r]
    assert rows[0].startswith("| paper's claim") and len(rows) > 8
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        assert len(cells) == 4, row
        assert len(cells[3].split()) <= 30, (len(cells[3].split()), cells[0])
        assert "](" in cells[1] or "](" in cells[2], f"{cells[0]}: no link to its results"
