"""The method registry: the ONLY place that maps method names to components, and the one source of what a
method is.

A method = row selector + token selector + objective + optional controllers (``eslm.contracts``); the step never
branches on a name. Each line (``MethodSpec``) also gives its ``role``, ``control`` and ``needs``, which the
report, the study and the tests read instead of method names. Adding a method: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from eslm import contracts, seeds
from eslm.baselines.greats import GreatsRows, GreatsSection
from eslm.baselines.rho1 import Rho1Section, Rho1Selector
from eslm.data.loader import TrainLoader
from eslm.model.gpt import ModelConfig
from eslm.objectives.base import CrossEntropy
from eslm.objectives.frozen import ReferenceModel
from eslm.objectives.kd_objective import Distill, KDSection, Salt, SaltSection
from eslm.selection.ada import AdaController, AdaSection
from eslm.selection.domain_random import DomainRandomSelector
from eslm.selection.instances import InstanceRows, InstanceSection
from eslm.selection.rows import AllRows
from eslm.selection.scores import STANDARDIZE_MODES
from eslm.selection.selectors import AllTokens, RandomSelector, VaRSelector
from eslm.settings import Section, setting

S = TypeVar("S", bound=Section)


@dataclass(frozen=True)
class SharedMethodSettings:
    """The ``method.*`` settings every method shares. ``eslm.config`` assembles the ``method`` section from it and
    one field per config section that a registered method names (``MethodSpec.settings``)."""

    name: str = setting("eslm-entropy", "training method; `eslm train --help` lists them")
    alpha: float = setting(0.1, "VaR confidence level: the fraction of tokens dropped (keep the top 1-alpha)")
    standardize: str = setting("none", f"score standardisation: {' | '.join(STANDARDIZE_MODES)}")
    scope: str = setting("micro", "selection scope: micro (per micro-batch per rank, the paper) | step (whole optimizer step, all ranks; one extra forward)")


@dataclass
class BuildContext:
    """What a method's components may need at construction time: the run's settings as plain values
    (``eslm.config.method_context`` makes one from a ``Config``; the registry sits below the config and does not
    know it) and what the trainer built. ``section(cls)``: the method's own config section of class ``cls``
    (``method.<cls.key>.*``), typed; val_loader_factory: rows -> ``TrainLoader`` of held-out windows."""

    method: SharedMethodSettings
    sections: dict[str, Section]
    device: torch.device
    n_domains: int
    seq_len: int
    micro_batch_size_seqs: int
    seed: int
    loss_impl: str  # the train.loss_* settings: their one default is the config's
    loss_chunk_size: int
    loss_cache_probs: bool
    loss_route: str
    rank: int = 0
    model_config: ModelConfig | None = None
    val_loader_factory: Callable[[int], TrainLoader] | None = None

    def section(self, cls: type[S]) -> S:
        """The method's config section of class ``cls`` (``method.<cls.key>``)."""
        sec = self.sections.get(cls.key)
        if not isinstance(sec, cls):
            raise TypeError(f"method {self.method.name!r}: no config section {cls.__name__} at method.{cls.key}; "
                            f"name it in the method's MethodSpec(settings=...)")
        return sec


@dataclass
class Method:
    name: str
    rows: contracts.RowSelector = field(default_factory=AllRows)
    tokens: contracts.TokenSelector = field(default_factory=AllTokens)
    objective: contracts.Objective = field(default_factory=CrossEntropy)
    controllers: list[contracts.Controller] = field(default_factory=list)

    @property
    def needs_entropy(self) -> bool:
        """Whether the scoring pass computes the entropy: the token selector says so (``needs``)."""
        return "entropy" in self.tokens.needs

    def extra_work(self, tokens_seen: int) -> list[contracts.ExtraWork]:
        """What each component adds to one micro-batch of ``tokens_seen`` tokens (``eslm.flops`` counts it)."""
        return [self.tokens.extra_work(tokens_seen), self.objective.extra_work(tokens_seen),
                self.rows.extra_work(tokens_seen)]

    def on_step_end(self, step: int) -> None:
        for c in self.controllers:
            c.on_step_end(step)
        self.objective.on_step_end(step)

    def observe(self, selection) -> None:
        for c in self.controllers:
            c.observe(selection)

    def state_dict(self) -> dict:
        return {"rows": self.rows.state_dict(), "tokens": self.tokens.state_dict(),
                "objective": self.objective.state_dict(),
                "controllers": [c.state_dict() for c in self.controllers]}

    def load_state_dict(self, sd: dict) -> None:
        self.rows.load_state_dict(sd["rows"])
        self.tokens.load_state_dict(sd["tokens"])
        self.objective.load_state_dict(sd["objective"])
        for c, s in zip(self.controllers, sd["controllers"]):
            c.load_state_dict(s)


ROLES = ("baseline", "control", "method")  # MethodSpec.role


@dataclass(frozen=True)
class Need:
    """What a method needs beyond the training stream. ``kind``: reference | teacher | held_out; ``words``: how an
    error names it; ``key``: the config key that supplies it (a frozen model's RUN_DIR|CHECKPOINT, required), or
    "" when the trainer supplies it (held-out data: ``BuildContext.val_loader_factory``, docs/data.md)."""

    kind: str
    words: str
    key: str = ""


REFERENCE = Need("reference", "a reference model", "method.rho1.reference")
TEACHER = Need("teacher", "a teacher model", "method.kd.teacher")
HELD_OUT = Need("held_out", "held-out data (a held-out tail of the training split)")


@dataclass(frozen=True)
class MethodSpec:
    """One registry line. ``validate``: the checks that span sections; ``settings``: its own config sections
    (``eslm.settings.Section`` classes, each at ``method.<its key>.*``).

    role: "baseline" (the one every method is compared with; one line has it), "control" (a reference point that
          selects without a score, e.g. random drop) or "method".
    control: the control this method must beat: the report pairs its runs with that method's runs at the same
          ``method.alpha``; "" = none.
    needs: ``Need``s; one with a config key makes that key required (``problems``)."""

    name: str
    help: str
    build: Callable[[BuildContext], Method]
    validate: Callable[[SharedMethodSettings], list[str]] = lambda method: []
    settings: tuple[type[Section], ...] = ()
    role: str = "method"
    control: str = ""
    needs: tuple[Need, ...] = ()

    @property
    def frozen_models(self) -> tuple[Need, ...]:
        """The needs a run supplies by a config key (a frozen reference or teacher model)."""
        return tuple(n for n in self.needs if n.key)

    def problems(self, method: SharedMethodSettings) -> list[str]:
        """This method's problems with the config's ``method`` section (the shared settings and every registered
        section): a needed model whose key is unset, then ``validate``'s."""
        out = []
        for need in self.frozen_models:
            value: object = method
            for part in need.key.split(".")[1:]:  # method.<section>.<key>
                value = getattr(value, part)
            if not value:
                out.append(f"{need.key}: {self.name} needs {need.words}; set {need.key}=RUN_DIR|CHECKPOINT")
        return out + self.validate(method)


def _ce(ctx: BuildContext) -> CrossEntropy:
    return CrossEntropy(impl=ctx.loss_impl, chunk_size=ctx.loss_chunk_size, cache_probs=ctx.loss_cache_probs,
                        route=ctx.loss_route)


def _var_selector(score: str, ctx: BuildContext) -> VaRSelector:
    m = ctx.method
    return VaRSelector(score, m.alpha, m.standardize, ctx.n_domains, m.scope)


def _random_selector(ctx: BuildContext) -> RandomSelector:
    return RandomSelector(ctx.method.alpha, seed=seeds.random_control(ctx.seed, ctx.rank), n_domains=ctx.n_domains,
                          device=ctx.device)


def _var(score: str, ctx: BuildContext) -> Method:
    return Method(name=ctx.method.name, tokens=_var_selector(score, ctx), objective=_ce(ctx))


def _ada(score: str, ctx: BuildContext) -> Method:
    sel, a = _var_selector(score, ctx), ctx.section(AdaSection)
    ada = AdaController(sel, gamma=a.gamma, interval=a.interval, eps=a.eps, alpha_min=a.alpha_min,
                        alpha_max=a.alpha_max)
    return Method(name=ctx.method.name, tokens=sel, objective=_ce(ctx), controllers=[ada])


def _clm(ctx: BuildContext) -> Method:
    return Method(name="clm", objective=_ce(ctx))


def _random(ctx: BuildContext) -> Method:
    return Method(name="random", tokens=_random_selector(ctx), objective=_ce(ctx))


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> None:
    """Add a registry line; a role or need that the registry cannot honour is a programming error (that each
    ``control`` names a line of role "control" is tests/test_methods.py's check)."""
    if spec.role not in ROLES:
        raise TypeError(f"method {spec.name!r}: role {spec.role!r} is not one of {', '.join(ROLES)}")
    if spec.role == "baseline" and any(s.role == "baseline" for s in METHODS.values()):
        raise TypeError(f"method {spec.name!r}: {baseline()!r} is already the baseline; one line has that role")
    METHODS[spec.name] = spec


def baseline() -> str:
    """The name of the baseline method (the registry line of role "baseline")."""
    return next(name for name, spec in METHODS.items() if spec.role == "baseline")


def holds_out(name: str) -> bool:
    """Whether runs of method ``name`` hold out a tail of the training split (it needs ``HELD_OUT``): their
    training stream leaves it out, their held-out stream draws from it (``eslm.data.loader.held_out_start``)."""
    return HELD_OUT in METHODS[name].needs


def role_of(name: str) -> str:
    """A method's role; "method" for a name this version does not register (a run written by another version)."""
    return METHODS[name].role if name in METHODS else "method"


def control_of(name: str) -> str | None:
    """The control a method's runs are compared with at the same alpha, or None (none, or an unknown name)."""
    return (METHODS[name].control or None) if name in METHODS else None


for _spec in [
    MethodSpec("clm", "causal LM: every token counts (the baseline)", _clm, role="baseline"),
    MethodSpec("eslm-entropy", "ESLM VaR-entropy: keep the top 1-alpha tokens by predictive entropy", partial(_var, "entropy"),
               control="random"),
    MethodSpec("eslm-loss", "ESLM CVaR-loss: keep the top 1-alpha tokens by loss (minimises CVaR_alpha)", partial(_var, "loss"),
               control="random"),
    MethodSpec("random", "control: keep 1-alpha of the tokens uniformly at random", _random, role="control"),
    MethodSpec("random-domain", "control: ESLM-entropy's kept count per domain, drawn uniformly at random in each domain",
               lambda ctx: Method(name="random-domain", objective=_ce(ctx), tokens=DomainRandomSelector(
                   "entropy", ctx.method.alpha, seeds.random_control(ctx.seed, ctx.rank), ctx.method.standardize,
                   ctx.n_domains, ctx.method.scope, ctx.device)), role="control"),
    MethodSpec("ada-eslm-entropy", "Ada-ESLM on entropy: alpha adapted by the CVaR controller", partial(_ada, "entropy"),
               settings=(AdaSection,), control="random"),
    MethodSpec("ada-eslm-loss", "Ada-ESLM on loss: alpha adapted by the CVaR controller", partial(_ada, "loss"),
               settings=(AdaSection,), control="random"),
]:
    register(_spec)


def build_method(ctx: BuildContext) -> Method:
    return METHODS[ctx.method.name].build(ctx)


def describe_methods() -> str:
    return "\n".join(f"  {n:<18} {s.help}" for n, s in METHODS.items())


# ---------------------------------------------------------------- baselines and distillation


def _frozen(path: str, ctx: BuildContext) -> ReferenceModel:
    return ReferenceModel.from_path(path, ctx.device, impl=ctx.loss_impl, chunk_size=ctx.loss_chunk_size)


def _rho1(ctx: BuildContext) -> Method:
    m = ctx.method
    sel = Rho1Selector(_frozen(ctx.section(Rho1Section).reference, ctx), m.alpha, ctx.seq_len, m.standardize,
                       ctx.n_domains, m.scope)
    return Method(name="rho1", tokens=sel, objective=_ce(ctx))


def _greats(ctx: BuildContext) -> Method:
    rows = GreatsRows(ctx.section(GreatsSection), alpha=ctx.method.alpha, micro_batch_size_seqs=ctx.micro_batch_size_seqs,
                      seed=ctx.seed, val_loader_factory=ctx.val_loader_factory, model_config=ctx.model_config,
                      device=ctx.device)
    return Method(name="greats", rows=rows, objective=_ce(ctx))


def _distill(ctx: BuildContext) -> Distill:
    kd = ctx.section(KDSection)
    return Distill(_frozen(kd.teacher, ctx), lam=kd.lambda_, rho=kd.temperature, seq_len=ctx.seq_len,
                   chunk_size=ctx.loss_chunk_size, impl=ctx.loss_impl)


def _dense_kd(ctx: BuildContext) -> Method:
    return Method(name="dense-kd", objective=_distill(ctx))


def _eslm_kd(score: str, ctx: BuildContext) -> Method:
    return Method(name=ctx.method.name, tokens=_var_selector(score, ctx), objective=_distill(ctx))


def _random_kd(ctx: BuildContext) -> Method:
    """ESLM-KD's control: KD on a uniformly random subset of ESLM-KD's size (the random control's selector)."""
    return Method(name="random-kd", tokens=_random_selector(ctx), objective=_distill(ctx))


def _salt(ctx: BuildContext) -> Method:
    return Method(name="salt", objective=Salt(_distill(ctx), _ce(ctx), ctx.section(SaltSection).kd_steps))


def _greats_validate(method: SharedMethodSettings) -> list[str]:
    return [] if method.scope == "micro" else ["method.scope: greats selects rows, so only scope=micro applies"]


for _spec in [
    MethodSpec("rho1", "Rho-1: keep the top 1-alpha tokens by excess loss against a frozen reference model",
               _rho1, settings=(Rho1Section,), control="random", needs=(REFERENCE,)),
    MethodSpec("dense-kd", "dense distillation: lambda*KL(teacher||student) + (1-lambda)*CE on every token",
               _dense_kd, settings=(KDSection,), control="random", needs=(TEACHER,)),
    MethodSpec("eslm-kd-entropy", "ESLM-KD: KD on the top 1-alpha tokens by the student's entropy",
               partial(_eslm_kd, "entropy"), settings=(KDSection,), control="random-kd", needs=(TEACHER,)),
    MethodSpec("eslm-kd-loss", "ESLM-KD: KD on the top 1-alpha tokens by the student's loss",
               partial(_eslm_kd, "loss"), settings=(KDSection,), control="random-kd", needs=(TEACHER,)),
    MethodSpec("random-kd", "control of ESLM-KD: KD on 1-alpha of the tokens kept uniformly at random",
               _random_kd, settings=(KDSection,), role="control", needs=(TEACHER,)),
    MethodSpec("salt", "SALT: dense KD for method.salt.kd_steps steps, then plain CE",
               _salt, settings=(KDSection, SaltSection), control="random", needs=(TEACHER,)),
    MethodSpec("greats", "GREATS: greedy online row selection by ghost gradient inner products with a validation batch",
               _greats, _greats_validate, settings=(GreatsSection,), control="random", needs=(HELD_OUT,)),
]:
    register(_spec)


# ---------------------------------------------------------------- instance-level selection (the authors' revision)


def _instance_rows(score: str | None, ctx: BuildContext) -> InstanceRows:
    sec = ctx.section(InstanceSection)
    if ctx.model_config is None:
        raise TypeError(f"method {ctx.method.name!r}: the exit's cost needs BuildContext.model_config")
    return InstanceRows(beta=sec.beta, exit_layers=sec.exit_layers, score=score, model_config=ctx.model_config,
                        seq_len=ctx.seq_len, impl=ctx.loss_impl, chunk_size=ctx.loss_chunk_size,
                        seed=seeds.random_instances(ctx.seed, ctx.rank), device=ctx.device)


def _eslm_h(score: str, ctx: BuildContext) -> Method:
    return Method(name=ctx.method.name, rows=_instance_rows(score, ctx), tokens=_var_selector(score, ctx),
                  objective=_ce(ctx))


def _random_instance(ctx: BuildContext) -> Method:
    return Method(name=ctx.method.name, rows=_instance_rows(None, ctx), objective=_ce(ctx))


def _random_h(ctx: BuildContext) -> Method:
    return Method(name=ctx.method.name, rows=_instance_rows(None, ctx), tokens=_random_selector(ctx), objective=_ce(ctx))


for _spec in [
    MethodSpec("eslm-h-entropy", "ESLM-H: keep the top 1-beta sequences by an early exit's mean entropy, then the top "
               "1-alpha tokens by entropy", partial(_eslm_h, "entropy"), settings=(InstanceSection,), control="random-h"),
    MethodSpec("eslm-h-loss", "ESLM-H: keep the top 1-beta sequences by an early exit's mean loss, then the top "
               "1-alpha tokens by loss", partial(_eslm_h, "loss"), settings=(InstanceSection,), control="random-h"),
    MethodSpec("random-instance", "control: keep 1-beta of the sequences uniformly at random (no exit), every token",
               _random_instance, settings=(InstanceSection,), role="control"),
    MethodSpec("random-h", "control of ESLM-H: 1-beta of the sequences, then 1-alpha of their tokens, uniformly at "
               "random", _random_h, settings=(InstanceSection,), role="control"),
]:
    register(_spec)
