"""Every ``eslm ...`` command line of README.md and docs/*.md parses with that command's own parser.

Lines come from code blocks (continuations joined, ``# comments`` and ``$ `` prompts dropped, ``&&`` chains
split, ``torchrun ... -m eslm.cli`` / ``--no-python eslm`` prefixes removed) and from inline code spans.
Placeholders are dropped before parsing: ``...``, ``<...>``, ``[...]`` and words holding a shell variable.
Where cheap, a line is also run: ``eslm train`` lines without placeholders resolve their config
(``--print-config``), ``eslm study`` lines plan their grid (``--dry-run``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from eslm.cli import COMMANDS, command_parser, main, parse_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _segments(line: str) -> list[str]:
    """The ``eslm ...`` commands of one shell line (prompt, comment and non-eslm parts removed)."""
    out = []
    for part in re.split(r"&&|;|\|\|", line):
        part = part.strip().removeprefix("$ ").strip()
        m = re.match(r"torchrun\b.*?(?:-m eslm\.cli|--no-python eslm)\s+(.*)", part)
        if m:
            part = "eslm " + m.group(1)
        if part.startswith("eslm "):
            out.append(part)
    return out


def doc_commands() -> list[tuple[str, str, str]]:
    """(file, "block" or "inline", command line) of every eslm command in the docs."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                found += [(path.name, "block", s) for s in _segments(line)]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`(eslm [a-z][^`]*)`", prose):
            found += [(path.name, "inline", s) for s in _segments(span.replace("\\|", "|"))]
    return found


def _argv(line: str) -> tuple[list[str], bool]:
    """(argv after ``eslm``, whether placeholders were dropped)."""
    cleaned = re.sub(r"<[^>]*>|\[[^\]]*\]", " ", line)
    words = shlex.split(cleaned, comments=True)[1:]
    kept = [w for w in words if not w.endswith("...") and "$" not in w]
    upper = any(re.fullmatch(r"[A-Z][A-Z0-9_|]*(=[A-Z0-9_|.]*)?", w) for w in kept)  # RUN_DIR, NAME|FILE
    return kept, upper or cleaned != line or len(kept) != len(words)


def _is_mention(where_line: str, argv: list[str]) -> bool:
    """An inline span naming a command and maybe options (`eslm eval --all-checkpoints`), no full line."""
    return where_line == "inline" and all(a.startswith("-") for a in argv[1:])


COMMAND_LINES = doc_commands()


def test_the_docs_name_every_command():
    assert len(COMMAND_LINES) > 40
    named = {_argv(line)[0][0] for _, _, line in COMMAND_LINES if _argv(line)[0]}
    assert named == set(COMMANDS), set(COMMANDS) ^ named


@pytest.mark.parametrize("where,kind,line", COMMAND_LINES,
                         ids=[f"{w}:{i}" for i, (w, _, _) in enumerate(COMMAND_LINES)])
def test_doc_command_parses(where, kind, line, tmp_path, capsys, monkeypatch):
    argv, placeholders = _argv(line)
    if not argv or argv[0] not in COMMANDS:
        assert not argv, f"{where}: unknown command in {line!r}"
        return
    name, rest = argv[0], argv[1:]
    if "--help" in rest:  # the help text itself is exercised by the CLI tests
        rest.remove("--help")
    if _is_mention(kind, argv):
        module, parser = command_parser(name)
        if not getattr(module, "PASSTHROUGH", False):
            unknown = [a for a in rest if a.split("=")[0] not in parser._option_string_actions]
            assert not unknown, f"{where}: {line!r} names options that eslm {name} lacks: {unknown}"
        return
    if name == "lm-eval":  # passed through unchanged: lm-eval's own parser must accept it
        lm_cli = pytest.importorskip("lm_eval._cli")
        cli = lm_cli.HarnessCLI()
        if rest:
            cli._parser.parse_args(rest if rest[0] in cli._subparsers.choices else ["run", *rest])
        return
    try:
        parse_command(name, rest)
    except SystemExit as e:
        pytest.fail(f"{where}: {line!r} does not parse: {capsys.readouterr().err.strip()} (exit {e.code})")
    if placeholders:
        return
    if name == "train":
        assert main(["train", *rest, "--print-config"]) == 0, capsys.readouterr().err
    elif name == "study" and ((ROOT / "configs" / "studies" / f"{rest[0]}.yaml").is_file()
                              or (ROOT / rest[0]).is_file()):  # not a user's own file (my-grid.yaml)
        monkeypatch.chdir(ROOT)
        assert main(["study", *rest, "--dry-run", "--out", str(tmp_path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("argv,key,value", [
    (["study", "demo", "--out", "X", "a.b=1"], "overrides", ["a.b=1"]),
    (["train", "cfg.yaml", "--print-config", "method.name=x"], "items", ["cfg.yaml", "method.name=x"]),
    (["prepare", "text", "--out", "d", "code=src/", "--force", "notes=docs/*.md"], "paths", ["code=src/", "notes=docs/*.md"]),
    (["eval", "r1", "--all-checkpoints", "r2"], "paths", ["r1", "r2"]),
    (["report", "r1", "--out", "o", "r2"], "run_dirs", ["r1", "r2"]),
    (["tokens", "--out", "o", "r1", "--data", "d"], "checkpoint", "r1"),
    (["export-hf", "--out", "o", "r1"], "source", "r1"),
])
def test_options_may_sit_among_positionals(argv, key, value):
    _, args = parse_command(argv[0], argv[1:])
    assert getattr(args, key) == value
