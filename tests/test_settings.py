"""``eslm.settings`` and the method sections built from it: method settings nested by method (issue 16 item 6),
``method.kd.lambda``, ``method.salt.kd_steps``, ``method.rho1.reference``, ``method.greats.pool``, ...; every
section is declared next to its components and checks its own values; the old flat keys are refused with the new
key suggested, except in a run directory's stored config.yaml, which is read with them moved so that runs
written before the change still resume and still group with new runs in reports."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_overrides

from eslm.config import (RENAMED, MethodSection, all_keys, build_config, from_dict, method_sections, to_yaml,
                         upgrade_stored)
from eslm.errors import ConfigError

# A run directory's config.yaml ``method`` section as eslm wrote it before the nesting (written out by hand, not
# derived from RENAMED, so that a wrong or missing RENAMED entry fails here)
OLD_METHOD = {"name": "salt", "alpha": 0.1, "standardize": "none", "scope": "micro",
              "ada": {"gamma": 0.5, "interval": 1000, "eps": 1e-8, "alpha_min": 0.0, "alpha_max": 0.9},
              "reference": "ref.pt", "teacher": "teach.pt", "kd_lambda": 0.25, "kd_temperature": 2.0,
              "salt_kd_steps": 7, "greats_val_fraction": 0.25, "greats_pool": "pool", "greats_exclude_head": False,
              "greats_route": "memory", "greats_memory_cap_mb": 64.0}
NEW_OVERRIDES = ["method.name=salt", "method.rho1.reference=ref.pt", "method.kd.teacher=teach.pt",
                 "method.kd.lambda=0.25", "method.kd.temperature=2.0", "method.salt.kd_steps=7",
                 "method.greats.val_fraction=0.25", "method.greats.pool=pool", "method.greats.exclude_head=false",
                 "method.greats.route=memory", "method.greats.memory_cap_mb=64"]


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


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_old_flat_override_is_refused_with_the_new_key(old, new):
    assert new in all_keys() and old not in all_keys()
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[f"{old}=1"])
    assert f"{old} was renamed: did you mean {new}?" in str(e.value) and "\n" not in str(e.value)


def test_old_flat_key_in_a_yaml_file_is_refused(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text("method:\n  teacher: t\n  kd_lambda: 0.3\n")
    with pytest.raises(ConfigError, match="2 config problem") as e:
        build_config([str(f)])
    msg = str(e.value)
    assert "method.teacher was renamed: did you mean method.kd.teacher?" in msg
    assert "method.kd_lambda was renamed: did you mean method.kd.lambda?" in msg


def test_the_cli_refuses_an_old_key_in_one_line(capsys):
    from eslm.cli import main

    assert main(["train", "--print-config", "method.salt_kd_steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eslm train: error: ") and len(err.splitlines()) == 1
    assert "method.salt_kd_steps was renamed: did you mean method.salt.kd_steps?" in err


def test_allow_change_of_an_old_key_is_refused_with_the_new_key():
    from eslm.train.resume import allowed_changes

    with pytest.raises(ConfigError, match="method.greats_pool was renamed: did you mean method.greats.pool?"):
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
    from eslm.baselines.plugins import GreatsSection, GreatsRows
    from eslm.baselines.rho1 import Rho1Section
    from eslm.objectives.kd_objective import Distill, KDSection, Salt, SaltSection
    from eslm.selection.ada import AdaController, AdaSection

    pairs = {"ada": (AdaSection, AdaController), "rho1": (Rho1Section, Rho1Section), "kd": (KDSection, Distill),
             "salt": (SaltSection, Salt), "greats": (GreatsSection, GreatsRows)}
    sections = method_sections(MethodSection())
    assert set(sections) == set(pairs)
    for name, (cls, component) in pairs.items():
        assert type(sections[name]) is cls and cls.__module__ == component.__module__


def test_paper_configs_build():
    paper = Path(__file__).resolve().parents[1] / "configs" / "paper"
    for name in ("rho1", "salt", "greats", "kd"):
        cfg = build_config([str(paper / "base.yaml"), str(paper / f"{name}.yaml")])
        assert cfg.method.name in ("rho1", "salt", "greats", "eslm-kd-entropy")
    assert build_config([str(paper / "salt.yaml")]).method.salt.kd_steps == 12000


# ---------------------------------------------------------------- stored configs of older run directories


def test_an_old_stored_config_reads_as_the_new_keys():
    old = {"run": {"seed": 3}, "method": OLD_METHOD}
    before = json.dumps(old, sort_keys=True)
    new = upgrade_stored(old)
    assert json.dumps(old, sort_keys=True) == before  # the argument is not changed
    assert from_dict(new) == build_config(overrides=NEW_OVERRIDES + ["run.seed=3"])
    assert new["method"]["kd"] == {"teacher": "teach.pt", "lambda": 0.25, "temperature": 2.0}
    assert not set(new["method"]) & {"reference", "teacher", "kd_lambda", "salt_kd_steps", "greats_route"}
    with pytest.raises(ConfigError, match="method.teacher was renamed"):  # not upgraded: refused
        from_dict(old)


def test_upgrade_leaves_new_and_partial_configs_alone():
    cfg = build_config(overrides=NEW_OVERRIDES)
    assert upgrade_stored(cfg.to_dict()) == cfg.to_dict()
    assert upgrade_stored({}) == {} and upgrade_stored({"method": {"kd_lambda": 0.3}}) == {
        "method": {"kd": {"lambda": 0.3}}}
    both = {"method": {"teacher": "a", "kd": {"teacher": "b"}}}  # an old key beside its new one is not guessed
    with pytest.raises(ConfigError, match="method.teacher was renamed"):
        from_dict(upgrade_stored(both))


def _as_old_run_dir(run_dir: Path) -> None:
    """Rewrite run_dir/config.yaml in the layout eslm wrote before the nesting (old flat method keys)."""
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    m = stored["method"]
    for old, new in [("reference", ("rho1", "reference")), ("teacher", ("kd", "teacher")),
                     ("kd_lambda", ("kd", "lambda")), ("kd_temperature", ("kd", "temperature")),
                     ("salt_kd_steps", ("salt", "kd_steps")), ("greats_val_fraction", ("greats", "val_fraction")),
                     ("greats_pool", ("greats", "pool")), ("greats_exclude_head", ("greats", "exclude_head")),
                     ("greats_route", ("greats", "route")), ("greats_memory_cap_mb", ("greats", "memory_cap_mb"))]:
        m[old] = m[new[0]].pop(new[1])
    for name in ("rho1", "kd", "salt", "greats"):
        assert m.pop(name) == {}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))


def test_an_old_run_directory_resumes_and_reports(tiny_data, tmp_path, capsys):
    from eslm.analysis.rundir import group_key, load_run
    from eslm.cli import main
    from eslm.train.resume import RESUMES_FILE, effective_config
    from eslm.train.trainer import train

    over = tiny_overrides(tiny_data, tmp_path, **{"method.name": "clm", "train.max_steps": 3,
                                                  "method.kd.lambda": 0.25})
    first = train(build_config(overrides=over))
    run_dir = Path(first.run_dir)
    new_cfg = effective_config(run_dir)
    _as_old_run_dir(run_dir)
    assert "kd_lambda: 0.25" in (run_dir / "config.yaml").read_text()
    assert effective_config(run_dir) == new_cfg  # read as the new keys

    # a recorded change of an old key (run.allow_change=method.kd_lambda before the nesting) is replayed too
    with open(run_dir / RESUMES_FILE, "a") as f:
        f.write(json.dumps({"time": "t", "step": 3, "changed": {"method.kd_lambda": [0.25, 0.5]}}) + "\n")
    assert effective_config(run_dir).method.kd.lambda_ == 0.5

    # eslm train --resume RUN_DIR continues with the run's own (old-layout) config: nothing refused
    assert main(["train", "--resume", str(run_dir), "train.max_steps=4"]) == 0, capsys.readouterr().err
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((run_dir / RESUMES_FILE).read_text().splitlines()[-1])["changed"] == {
        "train.max_steps": [3, 4]}
    # resuming with the user's own overrides (new keys) compares equal to the old run's config
    again = over + ["method.kd.lambda=0.5", "train.max_steps=5", "run.resume=true"]
    assert train(build_config(overrides=again)).stopped_by == "max_steps"
    # an old key in the user's resume command is refused, not mapped
    assert main(["train", "--resume", str(run_dir), "method.kd_lambda=0.5"]) == 2
    assert "did you mean method.kd.lambda?" in capsys.readouterr().err

    # the report reads the old directory with the new keys: it groups with a new run of the same settings
    other = train(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": "clm", "train.max_steps": 5, "method.kd.lambda": 0.5, "run.name": "u", "run.seed": 7})))
    old_run, new_run = load_run(run_dir), load_run(other.run_dir)
    assert old_run.config["method"]["kd"]["lambda"] == 0.5 and "kd_lambda" not in old_run.config["method"]
    assert group_key(old_run) == group_key(new_run)
