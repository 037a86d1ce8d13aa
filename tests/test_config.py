import os
from pathlib import Path

import pytest

from eslm.config import Config, all_keys, build_config, from_dict, to_yaml
from eslm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_valid():
    cfg = build_config()
    assert cfg.method.name == "eslm-entropy" and cfg.model.preset == "small"
    assert cfg.train.beta2 == 0.95 and cfg.train.weight_decay == 0.1


def test_yaml_deltas_then_overrides(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("method:\n  alpha: 0.3\ntrain:\n  max_steps: 7\n")
    b = tmp_path / "b.yaml"
    b.write_text("method:\n  alpha: 0.2\n")
    cfg = build_config([str(a), str(b)], ["train.max_steps=9", "checkpoint.milestones=[10,20]"])
    assert cfg.method.alpha == 0.2 and cfg.train.max_steps == 9
    assert cfg.checkpoint.milestones == (10, 20)


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match="did you mean 'method.alpha'"):
        build_config(overrides=["method.alpah=0.2"])


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as e:
        build_config(overrides=["method.alpha=1.5", "train.lr=abc", "method.name=eslm-entrop", "train.dtype=fp8"])
    msg = str(e.value)
    assert "4 config problem" in msg
    assert "did you mean 'eslm-entropy'" in msg and "train.dtype" in msg and "train.lr" in msg


def test_a_yaml_file_with_several_problems_lists_one_per_line_each_with_its_fix(tmp_path, capsys):
    from eslm.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: abc\n  max_stepz: 10\nmethod:\n  alpha: 2.0\n")
    assert main(["train", "--print-config", str(bad)]) == 2
    head, *lines = capsys.readouterr().err.strip().splitlines()
    assert head == "eslm train: error: 3 config problems:" and len(lines) == 3, lines
    assert lines[0] == ("  - train.lr: expected a number, found 'abc'; fix: set train.lr as expected, e.g. its "
                        f"default train.lr={Config().train.lr}")
    assert lines[1] == "  - unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"
    assert lines[2].startswith("  - method.alpha: expected 0 <= alpha < 1") and "got 2.0; fix: set method.alpha" in \
        lines[2]
    # one problem stays on one line
    assert main(["train", "--print-config", "train.lr=abc"]) == 2
    assert capsys.readouterr().err.strip().startswith("eslm train: error: config problem: train.lr: expected a number")


def test_resolved_config_round_trips():
    import yaml

    cfg = build_config(overrides=["method.ada.gamma=0.7"])
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


def test_every_config_file_loads_and_validates(tmp_path):
    from eslm.study import load_study, plan

    files = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        build_config([str(f)])
    # the paper's composition: base + model + data (+ variant)
    build_config([str(ROOT / "configs/paper/base.yaml"), str(ROOT / "configs/paper/774m.yaml"),
                  str(ROOT / "configs/paper/slimpajama-doremi.yaml"), str(ROOT / "configs/paper/ada-eslm.yaml")])
    studies = sorted((ROOT / "configs" / "studies").glob("*.yaml"))
    assert studies
    for f in studies:
        runs = plan(load_study(str(f)), tmp_path)
        assert runs and all(r.train.max_flops > 0 for r in runs)


def test_keys_have_help():
    keys = all_keys()
    assert len(keys) > 40
    assert all(h for _, h in keys.values())


def test_a_stored_config_of_an_earlier_eslm_names_its_problem():
    # a run directory's config.yaml is resolved by the eslm that wrote it: this version reads its own format only
    from eslm.config import stored_config_problem

    assert stored_config_problem(build_config().to_dict()) is None
    assert stored_config_problem({}) is None and stored_config_problem({"method": {"alpha": 0.2}}) is None
    assert stored_config_problem({"train": {"lr": 1e-3}}) is None  # a report reads what there is
    old = build_config().to_dict()
    del old["train"]["lr_schedule"]
    assert stored_config_problem(old) is None
    assert stored_config_problem(old, complete=True) == "no train.lr_schedule: written before the key existed"
    assert stored_config_problem({"train": {"lr": 1e-3}}, complete=True).startswith("no run.name (and ")
    assert stored_config_problem({"method": {"kd_lambda": 0.3}}) == (
        "unknown config key 'method.kd_lambda'; did you mean 'method.kd.lambda'?")
    assert stored_config_problem({"train": {"lr": "fast", "lr_schedule": "steps"}}) == "train.lr: expected a number, found 'fast'"


def test_config_choices_are_the_constants_of_the_code_that_reads_them():
    # a choice list copied into config.py drifts from the code that acts on the value
    from eslm import config, flops
    from eslm.data.tokenizers import TOKENIZER_NAMES
    from eslm.ops.head_route import ROUTE_CHOICES
    from eslm.selection.scores import STANDARDIZE_MODES
    from eslm.selection.selectors import SCOPES

    owners = {"train.loss_route": ROUTE_CHOICES, "data.tokenizer": TOKENIZER_NAMES, "method.standardize": STANDARDIZE_MODES, "method.scope": SCOPES,
              "flops.count_per": flops.COUNT_PER, "flops.budget_counter": flops.COUNTER_KEYS}
    assert all(config._CHOICES[k] is v for k, v in owners.items())


def test_method_settings_are_typed_for_a_checker():
    # statically, cfg.method is the real dataclass SharedMethodSettings and a builder gets its own section as the
    # class it asked for (BuildContext.section); the registry gets plain values, not the application's Config
    import typing

    from eslm import methods
    from eslm.config import method_context
    from eslm.selection.ada import AdaSection

    assert typing.get_type_hints(Config)["method"] is methods.SharedMethodSettings
    assert isinstance(Config().method, methods.SharedMethodSettings)
    assert "cfg" not in typing.get_type_hints(methods.BuildContext)
    ctx = method_context(build_config(overrides=["method.name=ada-eslm-loss", "method.ada.gamma=0.25"]),
                         device="cpu", n_domains=1)
    ada = ctx.section(AdaSection)
    assert type(ada) is AdaSection and ada.gamma == 0.25


def test_a_method_with_a_setting_edits_its_own_module_and_its_registry_line():
    # the method tree is assembled from the registry: a new Section named in a MethodSpec becomes method.<key>.*
    # with its defaults, help and checks, and config.py names no method's section
    import ast
    import dataclasses
    from pathlib import Path

    from eslm import config
    from eslm.methods import METHODS, MethodSpec
    from eslm.settings import Section, setting

    @dataclasses.dataclass(frozen=True)
    class NewSection(Section):
        key, help = "new", "a new method"
        width: int = setting(3, "how wide")

        def problems(self):
            return [] if self.width > 0 else [f"width: expected > 0, got {self.width}"]

    spec = MethodSpec("new-method", "help", build=lambda ctx: None, settings=(NewSection,))
    cls = config.method_section_class([*METHODS.values(), spec])
    inst = cls()
    assert inst.new == NewSection() and inst.new.width == 3 and config.method_sections(inst)["new"] is inst.new
    assert config.all_keys(cls)["new.width"] == (3, "how wide")
    registered = {c.key: c for s in METHODS.values() for c in s.settings}
    assert {k: type(v) for k, v in config.method_sections(config.Config().method).items()} == registered
    clash = dataclasses.make_dataclass("Clash", [], bases=(Section,), frozen=True)
    clash.key = "kd"
    try:
        config.method_section_class([*METHODS.values(), MethodSpec("x", "h", lambda c: None, settings=(clash,))])
    except TypeError as e:
        assert "needs a key of its own" in str(e)
    else:
        raise AssertionError("two sections under method.kd were accepted")
    imported = {n.module for n in ast.walk(ast.parse(Path(config.__file__).read_text()))
                if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith(("eslm.baselines", "eslm.objectives")) or m == "eslm.selection.ada" for m in imported)


def test_a_preset_fits_the_default_seq_len_to_its_context(tmp_path):
    assert build_config(overrides=["model.preset=tiny"]).data.seq_len == 64  # the tiny preset's context
    assert build_config(overrides=["model.preset=small", "model.block_size=32"]).data.seq_len == 32
    assert build_config(overrides=["model.preset=gpt2-124m"]).data.seq_len == 128  # the default fits: kept
    assert build_config(overrides=["model.preset=tiny", "data.seq_len=16"]).data.seq_len == 16  # set: kept
    f = tmp_path / "seq.yaml"
    f.write_text("data:\n  seq_len: 100\nmodel:\n  preset: tiny\n")
    assert build_config([str(f)]).data.seq_len == 100  # set in a file: kept (training then says it is too long)


def test_warmup_longer_than_the_run_warns_once_in_one_line():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_config(overrides=["train.max_steps=30", "train.warmup_steps=30"])
        assert caught == []
        build_config(overrides=["train.max_steps=10", "train.warmup_steps=30"])
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "train.warmup_steps=30 exceeds train.max_steps=10" in str(caught[0].message)
    assert "fix: set train.warmup_steps below train.max_steps" in str(caught[0].message)



def test_more_threads_than_cpus_warns_once_in_one_line():
    import warnings

    cpus = len(os.sched_getaffinity(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_config(overrides=[f"train.num_threads={cpus}"])
        assert caught == []
        build_config(overrides=[f"train.num_threads={cpus + 998}"])
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert f"train.num_threads={cpus + 998} exceeds the {cpus} CPUs" in str(caught[0].message)
    assert f"fix: train.num_threads={cpus}, or 0" in str(caught[0].message)

def test_an_override_without_equals_shows_the_fix():
    with pytest.raises(ConfigError, match=r"got 'train.max_steps'; fix: write train.max_steps=VALUE as one argument"):
        build_config(overrides=["train.max_steps"])


@pytest.mark.parametrize("override, words", [
    ("train.micro_batch_size_seqs=1000000000", "tokens per micro-batch: the activations kept for backward"),
    ("train.grad_accum_steps=1000000000", "tokens per optimizer step (its micro-batches are drawn together)"),
    ("model.block_size=1000000000", "model.block_size=1000000000: the positional table"),
])
def test_sizes_that_cannot_fit_in_memory_are_refused_with_the_estimate(override, words):
    """issue 47: refused in one line with a lower bound of the memory needed, before anything is allocated."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        build_config(overrides=["model.preset=tiny", override])
    msg = str(e.value)
    assert words in msg and "GiB, more than this machine's" in msg and "fix:" in msg, msg
    assert time.perf_counter() - t0 < 10
    assert build_config(overrides=["model.preset=tiny"]) is not None  # the defaults fit
