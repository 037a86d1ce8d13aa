"""eslm/files.py: names that stay one path component (issue 24 item 4)."""

import pytest

from eslm.config import build_config
from eslm.errors import ConfigError
from eslm.files import name_problem

BAD = ["", ".", "..", "../x", "a/b", "/abs", "a\\b", "x\x00y", "line\nbreak", ".hidden", "-opt", " pad", "pad ",
       "a:b", "a*b", "a?b", "a<b", "a>b", "a|b", "a\"b", "CON", "con", "nul.txt", "COM1", "lpt9.log", "abc\u202egpj.exe",
       "zero\u200bwidth",
       "x" * 201]
GOOD = ["t", "eslm-loss-alpha0.3-s2", "clm_small.s1", "Run+1", "x" * 200, "café", "CONSOLE", "com10", "a b"]


@pytest.mark.parametrize("name", BAD)
def test_unsafe_names_are_refused_in_one_line(name):
    problem = name_problem(name, "run.name")
    assert problem and problem.startswith("run.name: expected a single path-safe name") and "\n" not in problem


@pytest.mark.parametrize("name", GOOD)
def test_safe_names_pass(name):
    assert name_problem(name, "label") is None


def test_non_strings_are_refused():
    assert "got int 5" in name_problem(5, "label")


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", ".", "a/b"])
def test_run_name_is_validated_before_anything_runs(name):
    with pytest.raises(ConfigError, match="run.name: expected a single path-safe name"):
        build_config(overrides=[f"run.name={name}"])


def test_an_empty_run_name_means_the_default():
    assert build_config(overrides=["run.name="]).run.name == ""


# ------------------------------------------------------------------ the one YAML reader (issue 35)

import time  # noqa: E402

from eslm.files import MAX_YAML_DEPTH, read_yaml  # noqa: E402


def _bomb(levels: int = 9) -> str:
    text, prev = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n', "a"
    for name in "bcdefghijk"[:levels - 1]:
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    return text


@pytest.mark.parametrize("text, expected", [
    (_bomb(), "once its aliases (*name) are expanded"),
    ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", f"nesting deeper than {MAX_YAML_DEPTH} levels"),
    ("train:\n  lr: 1\ntrain:\n  lr: 2\n", "the key 'train' appears twice (lines 1 and 3)"),
    ("run: {seed: 1, seed: 2}\n", "the key 'seed' appears twice"),
    ("train: [1, 2\n", "expected ',' or ']'"),
    ("- 1\n- 2\n", "expected a mapping (key: value lines), found list"),
])
def test_yaml_problems_are_one_line_naming_the_file(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        read_yaml(path, "config file")
    assert time.monotonic() - t0 < 20  # the bomb and the deep nesting are refused, not expanded or recursed into
    msg = str(e.value)
    assert expected in msg and "\n" not in msg and msg.startswith(f"config file {str(path)!r}")


def test_yaml_must_be_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"expected UTF-8 text, found the byte 0xe9 on line 2 .*save the file as "
                                          r"UTF-8"):
        read_yaml(path)


def test_yaml_plain_aliases_and_merge_keys_still_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 1}\nx: *b\ny:\n  <<: *b\n  lr: 2\n")
    assert read_yaml(path) == {"base": {"lr": 1}, "x": {"lr": 1}, "y": {"lr": 2}}
    path.write_text("")
    assert read_yaml(path) == {}


def test_every_yaml_read_goes_through_the_one_reader():
    """No module of eslm parses YAML itself: yaml.safe_load/load/full_load appear only in eslm/files.py."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "eslm"
    readers = [str(p.relative_to(src)) for p in src.rglob("*.py")
               if re.search(r"yaml\.(safe_load|load|full_load|unsafe_load|compose)\b", p.read_text())]
    assert readers == [], readers


@pytest.mark.parametrize("cmd", [["train", "--print-config"], ["study", "--dry-run"]])
def test_commands_refuse_a_yaml_bomb_in_one_line(tmp_path, capsys, cmd):
    from eslm.cli import main

    path = tmp_path / "bomb.yaml"
    path.write_text("methods: [clm]\nseeds: [0]\nconfig:\n  run:\n    name: x\n" if cmd[0] == "study" else "")
    path.write_text(path.read_text() + "junk:\n" + "".join("  " + line + "\n" for line in _bomb().splitlines()))
    args = [cmd[0], str(path)] + cmd[1:]
    t0 = time.monotonic()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert time.monotonic() - t0 < 30 and "\n" not in err and "aliases (*name) are expanded" in err, err


def test_a_yaml_file_of_too_many_values_is_refused_fast_without_a_word_about_aliases(tmp_path):
    # issue 47: a million values as written were composed in Python for a minute, then refused as if aliases
    # had expanded them (the file has none); libyaml's events count them and stop at the limit
    path = tmp_path / "c.yaml"
    path.write_text("seeds: [" + ", ".join(str(i) for i in range(10**6)) + "]\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        read_yaml(path, "config file")
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "expected at most 100000 values, found more (line 1)" in msg and "alias" not in msg, msg
    assert took < 10, took  # 0.7 s on a loaded 2-core machine; a minute before
