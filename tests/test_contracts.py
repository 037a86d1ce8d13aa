"""The plug-in contracts (``eslm.contracts``): every component implements its protocol's every hook, the step
and the registry never probe components with hasattr, and extra work is declared in one dataclass."""

import ast
from pathlib import Path

import pytest
import torch

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
    from eslm.objectives.base import Objective
    from eslm.objectives.kd_objective import Salt

    salt = next(o for o in components[C.Objective] if isinstance(o, Salt))
    assert isinstance(salt, Objective)
    assert salt.active is salt.kd and salt.extra_work(8).frozen_forwards[0].tokens == 8
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


def _passes_run_and_declared(tokens, objective):
    """(tokens through the trained model, tokens through frozen models) that one two-micro-batch step runs,
    and the same as the method's components declare them (``extra_work``), on this rank."""
    from eslm.data.batch import Batch
    from eslm.methods import Method
    from eslm.model.gpt import GPT, preset
    from eslm.train.step import StepOptions, forward_backward

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64))
    g = torch.Generator().manual_seed(1)
    batches = [Batch(x, x.roll(-1, 1), torch.zeros(2, dtype=torch.long))
               for x in (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))]
    method = Method("m", tokens=tokens, objective=objective)
    run = {"trained": 0, "frozen": 0}
    model.register_forward_hook(lambda mod, args, out: run.__setitem__("trained", run["trained"] + args[0].numel()))
    frozen = getattr(tokens, "reference", None) or getattr(objective, "teacher", None)
    if frozen is not None:
        frozen.model.register_forward_hook(
            lambda mod, args, out: run.__setitem__("frozen", run["frozen"] + args[0].numel()))
    res = forward_backward(model, model, method, batches, StepOptions(accum_steps=2), step=1, lr=1e-3)
    work = method.extra_work(res.tokens_seen // len(batches))
    per_micro = {"trained": res.tokens_seen // len(batches) + sum(w.trained_forward_tokens for w in work),
                 "frozen": sum(p.tokens for w in work for p in (*w.frozen_forwards, *w.repeated_frozen_forwards))}
    return run, {k: v * len(batches) for k, v in per_micro.items()}


def test_every_forward_a_method_runs_is_declared_in_its_extra_work():
    # the FLOPs accounting prices what the components declare: a forward they run and do not declare would be
    # missing from flops_executed (Rho-1 at scope "step" ran its reference twice and declared it once)
    from eslm.baselines.rho1 import Rho1Selector
    from eslm.baselines.rho1 import ReferenceModel
    from eslm.model.gpt import GPT, preset
    from eslm.objectives.base import CrossEntropy
    from eslm.objectives.kd_objective import Distill
    from eslm.selection.selectors import RandomSelector, TokenSelector, VaRSelector

    torch.manual_seed(3)
    ref = ReferenceModel(GPT(preset("tiny", vocab_size=64)), impl="naive")
    cases = {f"{name}@{scope}": make(scope) for scope in ("micro", "step") for name, make in {
        "eslm-entropy": lambda s: (VaRSelector("entropy", 0.3, scope=s), CrossEntropy(impl="naive")),
        "rho1": lambda s: (Rho1Selector(ref, 0.3, 16, scope=s), CrossEntropy(impl="naive")),
        "eslm-kd-loss": lambda s: (VaRSelector("loss", 0.3, scope=s), Distill(ref, lam=0.5, rho=1.0, seq_len=16)),
    }.items()}
    cases.update({"clm": (TokenSelector(), CrossEntropy()), "random": (RandomSelector(0.3, seed=0), CrossEntropy()),
                  "dense-kd": (TokenSelector(), Distill(ref, lam=0.5, rho=1.0, seq_len=16))})
    for name, (tokens, objective) in cases.items():
        run, declared = _passes_run_and_declared(tokens, objective)
        assert run == declared, name


def test_each_hook_is_declared_once(components):
    # the protocols in eslm.contracts declare and document every hook; the default base classes subclass them and
    # only implement (no near-copies of the docstrings), and every component is torch's Stateful as well
    from torch.distributed.checkpoint.stateful import Stateful as TorchStateful

    from eslm.objectives.base import Objective
    from eslm.selection.rows import AllRows
    from eslm.selection.selectors import TokenSelector

    for base, protocol in ((AllRows, C.RowSelector), (TokenSelector, C.TokenSelector), (Objective, C.Objective)):
        assert protocol in base.__mro__ and base is not protocol
        hooks = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
        hooks |= {"state_dict", "load_state_dict"}
        documented_again = sorted(n for n, v in vars(base).items() if n in hooks and v.__doc__)
        assert documented_again == [], f"{base.__name__} repeats {documented_again}"
    for parts in components.values():
        for part in parts:
            assert isinstance(part, TorchStateful), type(part).__name__
