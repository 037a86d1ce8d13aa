"""The launcher seam (eslm.study.launch): every registered launcher has the whole ``Launcher`` protocol and owns
its section of the study file, and a new launcher with a key of its own is one class and its line in
``LAUNCHERS``: its key passes the study file's check, ``--status`` and the study reach it, the SLURM launcher's
module is not involved."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from eslm.errors import ConfigError
from eslm.study import launch, make_launcher, run_study
from eslm.study.launch import FINISHED, LAUNCHERS, Launched, Outcome, launcher_class, launcher_problems


def _study(tmp_path: Path, data: Path, launcher: str = "") -> Path:
    f = tmp_path / "tiny.yaml"
    f.write_text(f"""
methods: [clm]
seeds: [1]
{launcher}
config:
  data: {{dir: {data}, tokenizer: byte, seq_len: 32}}
  model: {{preset: tiny}}
  train: {{micro_batch_size_seqs: 4, grad_accum_steps: 1, max_steps: 3, warmup_steps: 1, num_threads: 1}}
  eval: {{interval: 3, tokens_per_domain: 256, batch_size_seqs: 4}}
  log: {{interval: 1, tensorboard: false}}
""")
    return f


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_every_registered_launcher_has_the_protocol_and_owns_its_section(name, tmp_path, capsys):
    cls = launcher_class(name)
    assert isinstance(cls.KEYS, tuple) and "name" not in cls.KEYS
    assert cls.section_problems({}) == [] and launcher_problems({"name": name}) == []
    assert launcher_problems({"name": name, "no_such_key": 1}) == [
        f"launcher: unknown key(s) 'no_such_key' for the {name} launcher; expected some of "
        + ", ".join(map(repr, ("name", *cls.KEYS)))]
    launcher = cls.from_study({"name": "s"}, {}, 2)
    assert callable(launcher.launch)
    run = type("C", (), {"run": type("R", (), {"name": "r-s1", "out_dir": str(tmp_path)})()})()
    assert launcher.status([run], tmp_path) == 0  # nothing submitted or trained: the run has not started
    assert "r-s1" in capsys.readouterr().out


@dataclass(frozen=True)
class FakeLauncher:
    """A launcher of the test's own: a key ``pods`` (an integer >= 1), its own status and launch."""

    study: str
    pods: int = 1
    calls: tuple = ()

    KEYS = ("pods",)

    @classmethod
    def section_problems(cls, section):
        n = section.get("pods", 1)
        return [] if isinstance(n, int) and n >= 1 else [f"launcher.pods: expected an integer >= 1, found {n!r}"]

    @classmethod
    def from_study(cls, study, section, jobs, *, detach=False):
        return cls(study["name"], section.get("pods", 1), ([],))

    def launch(self, configs, study_dir):
        self.calls[0].append(("launch", [c.run.name for c in configs]))
        return Launched(tuple(Outcome(c.run.name, FINISHED, f"finished on {self.pods} pods") for c in configs), 7)

    def status(self, configs, study_dir):
        print(f"fake: {self.pods} pods, {len(configs)} runs")
        return 5


def test_a_new_launcher_with_a_key_of_its_own_is_one_class_and_one_line(tmp_path, tiny_data, monkeypatch, capsys):
    monkeypatch.setitem(LAUNCHERS, "fake", f"{__name__}:FakeLauncher")  # the one line
    f = _study(tmp_path, tiny_data, "launcher: {name: fake, pods: 4}")
    assert run_study(str(f), tmp_path / "out", dry_run=True) == 0
    assert run_study(str(f), tmp_path / "out", status=True) == 5
    assert "fake: 4 pods, 1 runs" in capsys.readouterr().out
    built = make_launcher({"name": "tiny", "launcher": {"name": "fake", "pods": 4}})
    assert isinstance(built, FakeLauncher) and built.pods == 4
    assert run_study(str(f), tmp_path / "out", launcher=built) == 7  # its launch trains (here: says it did)
    assert built.calls[0] == [("launch", ["clm-s1"])]
    # its key is checked by it, and only by it: another launcher's key is unknown here, and pods is unknown to slurm
    f.write_text(f.read_text().replace("pods: 4", "pods: 0, partition: gpu"))
    with pytest.raises(ConfigError) as e:
        run_study(str(f), tmp_path / "out", dry_run=True)
    assert "launcher.pods: expected an integer >= 1, found 0" in str(e.value)
    assert "unknown key(s) 'partition' for the fake launcher" in str(e.value)
    assert launcher_problems({"name": "slurm", "pods": 4})[0].startswith("launcher: unknown key(s) 'pods' for "
                                                                          "the slurm launcher")


def test_a_section_without_a_name_belongs_to_the_launcher_that_runs(tmp_path, tiny_data, capsys):
    f = _study(tmp_path, tiny_data, "launcher: {parallel: 2}")
    assert run_study(str(f), tmp_path / "out", dry_run=True, launcher="slurm") == 0
    with pytest.raises(ConfigError, match=r"for the local launcher: launcher: unknown key\(s\) 'parallel' for the "
                                          r"local launcher"):
        run_study(str(f), tmp_path / "out", dry_run=True)
    # a section that names another launcher is that launcher's: --launcher local ignores it
    assert isinstance(make_launcher({"name": "tiny", "launcher": {"name": "slurm", "parallel": 2}}, "local"),
                      launch.LocalLauncher)


def test_local_status_tells_each_run_from_its_run_directory(tmp_path, tiny_data, capsys):
    f = _study(tmp_path, tiny_data)
    assert run_study(str(f), tmp_path / "out", status=True) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["  clm-s1  -           not started", "study tiny: 1 not started"]
    assert run_study(str(f), tmp_path / "out") == 0
    capsys.readouterr()
    assert run_study(str(f), tmp_path / "out", status=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["clm-s1", "step", "3"] and line.endswith("finished") for line in lines), lines
    assert lines[-1] == "study tiny: 1 finished"
