"""``eslm.settings`` and the method sections built from it: method settings nested by method (issue 16 item 6),
``method.kd.lambda``, ``method.salt.kd_steps``, ``method.rho1.reference``, ``method.greats.pool``, ...; every
section is declared next to its components and checks its own values; the old flat keys are refused with the
nearest key suggested, and a run directory whose config.yaml still holds them (written by an earlier eslm) is
refused in one line: eslm 0.x reads its own format only (issue 23 item 4: no rename shims)."""

from pathlib import Path

import pytest
import yaml

from conftest import tiny_overrides
from eslm.config import MethodSection, all_keys, build_config, from_dict, method_sections, to_yaml
from eslm.errors import ConfigError

# the flat method keys eslm used before the nesting, and the nested key each became (written out by hand)
FLAT_TO_NESTED = {"method.reference": "method.rho1.reference", "method.teacher": "method.kd.teacher",
                  "method.kd_lambda": "method.kd.lambda", "method.kd_temperature": "method.kd.temperature",
                  "method.salt_kd_steps": "method.salt.kd_steps", "method.greats_val_fraction": "method.greats.val_fraction",
                  "method.greats_pool": "method.greats.pool", "method.greats_exclude_head": "method.greats.exclude_head",
                  "method.greats_route": "method.greats.route", "method.greats_memory_cap_mb": "method.greats.memory_cap_mb"}


def test_nested_keys_from_overrides_and_yaml(tmp_path):
    f = tmp_path / "kd.yaml"
    f.write_text("method:\n  name: salt\n  kd:\n    teacher: t\n    lambda: 0.25\n  salt:\n    kd_steps: 7\n"
                 "  greats:\n    pool: pool\n    route: ghost\n")
    cfg = build_config([str(f)], ["method.kd.temperature=2.0", "method.greats.memory_cap_mb=32"])
    m = cfg.method
    assert (m.kd.teacher, m.kd.lambda_, m.kd.temperature, m.salt.kd_steps) == ("t", 0.25, 2.0, 7)
    assert (m.greats.pool, m.greats.route, m.greats.memory_cap_mb) == ("pool", "ghost", 32.0)
    stored = yaml.safe_load(to_yaml(cfg))
    assert stored["method"]["kd"]["lambda"] == 0.25 and "lambda_" not in stored["method"]["kd"]  # the key
    assert from_dict(stored) == cfg


def test_every_method_key_is_nested():
    flat = [k for k in all_keys() if k.startswith("method.") and k.count(".") == 1]
    assert flat == ["method.name", "method.alpha", "method.standardize", "method.scope"]  # shared by every method
    assert {"method.kd.lambda", "method.rho1.reference", "method.salt.kd_steps", "method.greats.route",
            "method.greats.memory_cap_mb", "method.ada.interval"} <= set(all_keys())


@pytest.mark.parametrize("old, new", sorted(FLAT_TO_NESTED.items()))
def test_old_flat_override_is_refused_with_the_new_key(old, new):
    assert new in all_keys() and old not in all_keys()
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[f"{old}=1"])
    assert f"unknown config key {old!r}; did you mean {new!r}?" in str(e.value) and "\n" not in str(e.value)


def test_old_flat_key_in_a_yaml_file_is_refused(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text("method:\n  teacher: t\n  kd_lambda: 0.3\n")
    with pytest.raises(ConfigError, match="2 config problem") as e:
        build_config([str(f)])
    msg = str(e.value)
    assert "unknown config key 'method.teacher'; did you mean 'method.kd.teacher'?" in msg
    assert "unknown config key 'method.kd_lambda'; did you mean 'method.kd.lambda'?" in msg


def test_the_cli_refuses_an_old_key_in_one_line(capsys):
    from eslm.cli import main

    assert main(["train", "--print-config", "method.salt_kd_steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eslm train: error: ") and len(err.splitlines()) == 1
    assert "unknown config key 'method.salt_kd_steps'; did you mean 'method.salt.kd_steps'?" in err


def test_allow_change_of_an_old_key_is_refused_with_the_new_key():
    from eslm.train.resume import allowed_changes

    with pytest.raises(ConfigError, match="unknown config key 'method.greats_pool'; did you mean 'method.greats.pool'"):
        allowed_changes(build_config(overrides=["run.allow_change=train.lr,method.greats_pool"]))
    assert "method.greats.pool" in allowed_changes(build_config(overrides=["run.allow_change=method.greats.pool"]))


@pytest.mark.parametrize("override, key", [
    ("method.kd.lambda=1.5", "method.kd.lambda: expected a value in [0, 1]"),
    ("method.kd.temperature=0", "method.kd.temperature: expected > 0"),
    ("method.salt.kd_steps=-1", "method.salt.kd_steps: expected >= 0"),
    ("method.greats.pool=ceil", "method.greats.pool: expected one of floor, pool"),
    ("method.greats.route=auto", "method.greats.route: expected one of flops, memory, ghost, materialised"),
    ("method.greats.val_fraction=0", "method.greats.val_fraction: expected in (0, 4]"),
    ("method.greats.memory_cap_mb=0", "method.greats.memory_cap_mb: expected > 0 MiB"),
    ("method.ada.interval=0", "method.ada.interval: expected a positive number"),
    ("method.ada.gamma=-1", "method.ada.gamma: expected >= 0"),
    ("method.ada.alpha_max=1", "method.ada.alpha_min, alpha_max: expected 0 <= alpha_min <= alpha_max < 1"),
    ("method.kd.lambda=nan", "method.kd.lambda: expected a finite number"),
    ("method.kd.lamda=0.5", "unknown config key 'method.kd.lamda'; did you mean 'method.kd.lambda'?"),
    ("method.kd.lambda_=0.5", "unknown config key 'method.kd.lambda_'"),  # the attribute is not a key
])
def test_each_section_checks_its_own_keys(override, key):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[override])
    assert key in str(e.value)


def test_required_models_name_the_nested_key():
    with pytest.raises(ConfigError, match=r"method\.rho1\.reference: rho1 needs a reference model; set "
                                          r"method\.rho1\.reference="):
        build_config(overrides=["method.name=rho1"])
    with pytest.raises(ConfigError, match=r"method\.kd\.teacher: salt needs a teacher model"):
        build_config(overrides=["method.name=salt"])


def test_sections_live_next_to_their_components():
    from eslm.baselines.greats import GreatsRows, GreatsSection
    from eslm.baselines.rho1 import Rho1Section, Rho1Selector
    from eslm.objectives.kd_objective import Distill, KDSection, Salt, SaltSection
    from eslm.selection.ada import AdaController, AdaSection

    pairs = {"ada": (AdaSection, AdaController), "rho1": (Rho1Section, Rho1Selector), "kd": (KDSection, Distill),
             "salt": (SaltSection, Salt), "greats": (GreatsSection, GreatsRows)}
    sections = method_sections(MethodSection())
    assert set(pairs) <= set(sections)  # a new method's section joins them without editing this test
    assert all(type(sec).__module__ != "eslm.config" for sec in sections.values())
    for name, (cls, component) in pairs.items():
        assert type(sections[name]) is cls and cls.__module__ == component.__module__


def test_paper_configs_build():
    paper = Path(__file__).resolve().parents[1] / "configs" / "paper"
    for name in ("rho1", "salt", "greats", "kd"):
        cfg = build_config([str(paper / "base.yaml"), str(paper / f"{name}.yaml")])
        assert cfg.method.name in ("rho1", "salt", "greats", "eslm-kd-entropy")
    assert build_config([str(paper / "salt.yaml")]).method.salt.kd_steps == 12000


# ---------------------------------------------------------------- run directories of an earlier eslm


def _as_old_run_dir(run_dir: Path) -> None:
    """Rewrite run_dir/config.yaml in the layout eslm wrote before the nesting (old flat method keys)."""
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    m = stored["method"]
    for old, new in FLAT_TO_NESTED.items():
        section, leaf = new.split(".")[1:]
        m[old.split(".")[1]] = m[section].pop(leaf)
    for name in ("rho1", "kd", "salt", "greats"):
        assert m.pop(name) == {}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))


def test_a_run_directory_of_an_earlier_eslm_is_refused_in_one_line(tiny_data, tmp_path, capsys):
    # no rename shims in a 0.x package: resuming or reporting such a run is one clear line, never a traceback
    # and never a silent misreading
    from eslm.analysis.rundir import load_run
    from eslm.cli import main
    from eslm.train.resume import effective_config
    from eslm.train.trainer import train

    over = tiny_overrides(tiny_data, tmp_path, **{"method.name": "clm", "train.max_steps": 2, "eval.interval": 2})
    run_dir = Path(train(build_config(overrides=over)).run_dir)
    assert effective_config(run_dir) == build_config(overrides=over)
    saved = (run_dir / "config.yaml").read_text()
    _as_old_run_dir(run_dir)
    for command in (["train", "--resume", str(run_dir), "train.max_steps=3"],
                    ["report", str(run_dir), "--out", str(tmp_path / "rep")]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "was written by an earlier eslm" in err, err
        assert "unknown config key 'method.reference'; did you mean 'method.rho1.reference'?" in err
    with pytest.raises(ConfigError, match="earlier eslm"):
        load_run(run_dir)

    # a config.yaml from before train.lr_schedule existed: a resume would fill in today's default and misread it
    stored = yaml.safe_load(saved)
    del stored["train"]["lr_schedule"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    assert main(["train", "--resume", str(run_dir), "train.max_steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was written by an earlier eslm: no train.lr_schedule" in err
    (run_dir / "config.yaml").write_text(saved)  # this version's own file: resumes
    assert main(["train", "--resume", str(run_dir), "train.max_steps=3"]) == 0, capsys.readouterr().err
