"""The plug-in contracts (``eslm.contracts``): every component implements its protocol's every hook, the step
and the registry never probe components with hasattr, and extra work is declared in one dataclass."""

import ast
from pathlib import Path

import pytest

from eslm import contracts as C

SRC = Path(__file__).resolve().parents[1] / "src" / "eslm"


def _parts(method) -> dict:
    """protocol -> the components of one built method (Salt's two objectives counted too)."""
    from eslm.objectives.kd_objective import Salt

    objectives = [method.objective] + ([method.objective.kd, method.objective.ce]
                                       if isinstance(method.objective, Salt) else [])
    return {C.RowSelector: [method.rows], C.TokenSelector: [method.tokens], C.Objective: objectives,
            C.Controller: list(method.controllers)}


@pytest.fixture(scope="module")
def components(tiny_data, frozen_run, tmp_path_factory):
    """protocol -> every component of every registered method, each built by the registry as a run builds it
    (a new component reaches these checks by its registry line, without editing this file)."""
    from conftest import build_registered
    from eslm.methods import METHODS

    out: dict = {C.RowSelector: [], C.TokenSelector: [], C.Objective: [], C.Controller: []}
    for name in METHODS:
        method = build_registered(name, tiny_data, tmp_path_factory.mktemp(name), frozen_run)
        for protocol, parts in _parts(method).items():
            out[protocol] += parts
    return out


def test_every_component_implements_every_hook_of_its_protocol(components):
    from eslm.methods import METHODS

    assert len(components[C.TokenSelector]) == len(METHODS)
    for protocol, parts in components.items():
        for part in parts:
            assert isinstance(part, protocol), f"{type(part).__name__} is not a {protocol.__name__}"
            if hasattr(protocol, "extra_work"):
                assert isinstance(part.extra_work(64), C.ExtraWork), type(part).__name__


def test_salt_is_an_objective_that_follows_its_switch(components):
    from eslm.objectives.base import BaseObjective
    from eslm.objectives.kd_objective import Salt

    salt = next(o for o in components[C.Objective] if isinstance(o, Salt))
    assert isinstance(salt, BaseObjective)
    assert salt.active is salt.kd and salt.extra_work(8).passes[0].tokens == 8
    salt.on_step_end(salt.kd_steps)
    assert salt.active is salt.ce and salt.extra_work(8) == C.ExtraWork()


def test_no_hasattr_probing_of_components():
    """The registry, the step, the FLOPs accounting and every component: no hasattr / 3-argument getattr."""
    files = [SRC / "methods.py", SRC / "flops.py", SRC / "train" / "step.py", *(SRC / "baselines").glob("*.py"),
             *(SRC / "selection").glob("*.py"), *(SRC / "objectives").glob("*.py")]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                    node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)):
                first = ast.unparse(node.args[0])
                if path.name == "step.py" and first == "model":  # DDP's no_sync: the wrapped model, not a component
                    continue
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def _counter(run, key, tokens: int):
    """A gradient hook that counts ``tokens`` under ``key`` each time a gradient arrives."""
    def hook(grad):
        run[key] += tokens
    return hook


def _count_passes(trainer, micro_batches: int = 2):
    """(passes run, passes declared) by one optimizer step of the trainer's method on two of its micro-batches (the
    declared passes per micro-batch that trained, as ``eslm.flops.FlopsCounter.add_step`` prices them):
    {(model, direction): tokens}, model "trained" or a frozen model's ModelConfig. Run: every forward of every GPT
    (the trained one, a reference, a teacher) and every backward through a GPT's output, counted as it happens.
    Declared: the trained model's forward and backward of the tokens seen (what ``eslm.flops`` prices from the
    token counts), the step's own passes (``StepResult.work``) and every component's ``extra_work``, including the
    passes a component's own price covers (``PricedWork.passes``)."""
    from collections import Counter
    from unittest import mock

    from eslm.model.gpt import GPT
    from eslm.train.step import StepOptions, forward_backward

    run: Counter = Counter()
    forward = GPT.forward

    def counted(self, idx, cache=None):
        out = forward(self, idx, cache)
        key = "trained" if self is trainer.raw_model else self.config
        run[(key, C.FORWARD)] += idx.numel()
        if out.requires_grad:
            out.register_hook(_counter(run, (key, C.BACKWARD), idx.numel()))
        return out

    batches = [trainer.loader.next_batch() for _ in range(micro_batches)]
    with mock.patch.object(GPT, "forward", counted):
        res = forward_backward(trainer.model, trainer.raw_model, trainer.method, batches,
                               StepOptions(accum_steps=micro_batches), step=1, lr=1e-3)
    trained = len(res.selections)  # the micro-batches that trained (instance selection keeps fewer than it read)
    per_micro = res.tokens_seen // trained
    declared: Counter = Counter({("trained", C.FORWARD): per_micro, ("trained", C.BACKWARD): per_micro})
    for work in (*trainer.method.extra_work(per_micro), res.work):
        for p in work.passes + tuple(p for w in work.priced for p in w.passes()):
            declared[("trained" if p.model is None else p.model, p.direction)] += p.tokens
    return run, Counter({k: v * trained for k, v in declared.items()})


def _registered_runs():
    """(method, scope) of every registered method, at the selection scope "step" too where its config allows."""
    from eslm.config import build_config
    from eslm.errors import ConfigError
    from eslm.methods import METHODS

    out = []
    for name, spec in METHODS.items():
        for scope in ("micro", "step"):
            try:
                build_config(overrides=[f"method.name={name}", f"method.scope={scope}",
                                        *(f"{need.key}=x" for need in spec.frozen_models)])
            except ConfigError:
                continue
            out.append((name, scope))
    return out


@pytest.mark.parametrize("name,scope", _registered_runs())
def test_every_pass_a_registered_method_runs_is_declared(name, scope, tiny_data, frozen_run, tmp_path):
    # the FLOPs ledger prices what the step and the components declare: a pass they run and do not declare would
    # be missing from flops_executed (Rho-1 at scope "step" ran its reference twice and declared it once)
    from conftest import needs_overrides, tiny_overrides
    from eslm.config import build_config
    from eslm.train.trainer import Trainer

    over = {"method.name": name, "method.scope": scope, **needs_overrides(name, frozen_run)}
    trainer = Trainer(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **over)))
    run, declared = _count_passes(trainer)
    assert run == declared


def test_each_hook_is_declared_once(components):
    # the protocols in eslm.contracts declare and document every hook; the default base classes subclass them and
    # only implement (no near-copies of the docstrings), and every component is torch's Stateful as well
    from torch.distributed.checkpoint.stateful import Stateful as TorchStateful

    from eslm.objectives.base import BaseObjective
    from eslm.selection.rows import AllRows
    from eslm.selection.selectors import AllTokens

    for base, protocol in ((AllRows, C.RowSelector), (AllTokens, C.TokenSelector), (BaseObjective, C.Objective)):
        assert protocol in base.__mro__ and base is not protocol
        hooks = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
        hooks |= {"state_dict", "load_state_dict"}
        documented_again = sorted(n for n, v in vars(base).items() if n in hooks and v.__doc__)
        assert documented_again == [], f"{base.__name__} repeats {documented_again}"
    for parts in components.values():
        for part in parts:
            assert isinstance(part, TorchStateful), type(part).__name__
