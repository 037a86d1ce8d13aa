"""The method registry: the ONLY place that maps method names to components.

A method = row selector (which rows train) + token selector (which tokens count) + objective (per-token
loss) + optional controllers (e.g. Ada-ESLM's alpha controller); their contracts are ``eslm.contracts``. The
training step only ever sees these components; it never branches on a name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from eslm import contracts, seeds
from eslm.baselines.plugins import GreatsSection
from eslm.baselines.rho1 import Rho1Section
from eslm.objectives.base import CrossEntropy
from eslm.objectives.kd_objective import KDSection, SaltSection
from eslm.selection.ada import AdaController, AdaSection
from eslm.selection.rows import AllRows
from eslm.selection.selectors import RandomSelector, TokenSelector, VaRSelector
from eslm.settings import Section

if TYPE_CHECKING:  # the config sits above the registry: annotations only
    from eslm.config import Config
    from eslm.model.gpt import ModelConfig


@dataclass
class BuildContext:
    """What a method's components may need at construction time."""

    cfg: Config
    device: torch.device
    n_domains: int
    rank: int = 0
    model_config: ModelConfig | None = None  # the trained model's
    # (batch_size_seqs) -> TrainLoader of validation windows (GREATS; its pool mode also builds its stream of
    # extra training candidates from this loader's dataset, mixture, seq_len and rank)
    val_loader_factory: Callable | None = None


@dataclass
class Method:
    name: str
    rows: contracts.RowSelector = field(default_factory=AllRows)
    tokens: contracts.TokenSelector = field(default_factory=TokenSelector)
    objective: contracts.Objective = field(default_factory=CrossEntropy)
    controllers: list[contracts.Controller] = field(default_factory=list)

    @property
    def needs_entropy(self) -> bool:
        return self.tokens.score == "entropy"

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


@dataclass(frozen=True)
class MethodSpec:
    """One registry line: a method's name, help, builder, the checks that span sections (``validate``) and its
    own config sections (``settings``: ``eslm.settings.Section`` classes, each at ``method.<its key>.*``; the
    config's ``method`` tree is assembled from the registered ones, so a new method with settings edits its own
    module and its line here)."""

    name: str
    help: str
    build: Callable[[BuildContext], Method]
    validate: Callable[[Config], list[str]] = lambda cfg: []
    settings: tuple[type[Section], ...] = ()


def _ce(ctx: BuildContext) -> CrossEntropy:
    t = ctx.cfg.train
    return CrossEntropy(impl=t.loss_impl, chunk_size=t.loss_chunk_size, cache_probs=t.loss_cache_probs,
                        route=t.loss_route)


def _var(score: str):
    def build(ctx: BuildContext) -> Method:
        m = ctx.cfg.method
        sel = VaRSelector(score, m.alpha, m.standardize, ctx.n_domains, m.scope)
        return Method(name=m.name, tokens=sel, objective=_ce(ctx))
    return build


def _ada(score: str):
    def build(ctx: BuildContext) -> Method:
        method = _var(score)(ctx)
        a = ctx.cfg.method.ada
        method.controllers.append(AdaController(method.tokens, gamma=a.gamma, interval=a.interval, eps=a.eps,
                                                alpha_min=a.alpha_min, alpha_max=a.alpha_max))
        return method
    return build


def _clm(ctx: BuildContext) -> Method:
    return Method(name="clm", objective=_ce(ctx))


def _random(ctx: BuildContext) -> Method:
    m = ctx.cfg.method
    sel = RandomSelector(m.alpha, seed=seeds.random_control(ctx.cfg.run.seed, ctx.rank), n_domains=ctx.n_domains)
    return Method(name="random", tokens=sel, objective=_ce(ctx))


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> None:
    METHODS[spec.name] = spec


for _spec in [
    MethodSpec("clm", "causal LM: every token counts (the baseline)", _clm),
    MethodSpec("eslm-entropy", "ESLM VaR-entropy: keep the top 1-alpha tokens by predictive entropy", _var("entropy")),
    MethodSpec("eslm-loss", "ESLM CVaR-loss: keep the top 1-alpha tokens by loss (minimises CVaR_alpha)", _var("loss")),
    MethodSpec("random", "control: keep 1-alpha of the tokens uniformly at random", _random),
    MethodSpec("ada-eslm-entropy", "Ada-ESLM on entropy: alpha adapted by the CVaR controller", _ada("entropy"),
               settings=(AdaSection,)),
    MethodSpec("ada-eslm-loss", "Ada-ESLM on loss: alpha adapted by the CVaR controller", _ada("loss"),
               settings=(AdaSection,)),
]:
    register(_spec)


def build_method(ctx: BuildContext) -> Method:
    return METHODS[ctx.cfg.method.name].build(ctx)


def describe_methods() -> str:
    return "\n".join(f"  {n:<18} {s.help}" for n, s in METHODS.items())


# ---------------------------------------------------------------- baselines and distillation


def _frozen(path: str, ctx: BuildContext):
    from eslm.objectives.frozen import ReferenceModel

    return ReferenceModel.from_path(path, ctx.device, impl=ctx.cfg.train.loss_impl,
                                    chunk_size=ctx.cfg.train.loss_chunk_size)


def _rho1(ctx: BuildContext) -> Method:
    from eslm.baselines.plugins import Rho1Selector

    m = ctx.cfg.method
    sel = Rho1Selector(_frozen(m.rho1.reference, ctx), m.alpha, ctx.cfg.data.seq_len, m.standardize, ctx.n_domains,
                       m.scope)
    return Method(name="rho1", tokens=sel, objective=_ce(ctx))


def _greats(ctx: BuildContext) -> Method:
    from eslm.baselines.greats import greats_pool_size, greats_val_rows
    from eslm.baselines.plugins import GreatsRows

    m, t = ctx.cfg.method, ctx.cfg.train
    B = t.micro_batch_size_seqs
    g = m.greats
    bv = greats_val_rows(B, g.val_fraction)
    val = ctx.val_loader_factory(bv)
    extra = greats_pool_size(B, 1.0 - m.alpha, g.pool)[0] - B
    rows = GreatsRows(val, alpha=m.alpha, exclude_head=g.exclude_head,
                      model_config=ctx.model_config, device=ctx.device, pool=g.pool,
                      route=g.route, memory_cap_mb=g.memory_cap_mb,
                      candidate_loader=_candidate_loader(val, extra, ctx.cfg.run.seed) if extra else None)
    return Method(name="greats", rows=rows, objective=_ce(ctx))


def _candidate_loader(val_loader, rows: int, seed: int):
    """GREATS pool mode's extra candidates: an independent stream of TRAINING windows with the validation
    stream's dataset, mixture (the training mixture), seq_len and rank (both are ``TrainLoader``s)."""
    from eslm.data.loader import TrainLoader

    v = val_loader
    return TrainLoader(v.dataset, seq_len=v.seq_len, micro_batch_size_seqs=rows, weights=v.weights,
                       seed=seeds.greats_candidates(seed), rank=v.rank, world_size=v.world_size, split="train")


def _distill(ctx: BuildContext):
    from eslm.objectives.kd_objective import Distill

    kd = ctx.cfg.method.kd
    return Distill(_frozen(kd.teacher, ctx), lam=kd.lambda_, rho=kd.temperature, seq_len=ctx.cfg.data.seq_len,
                   chunk_size=ctx.cfg.train.loss_chunk_size, impl=ctx.cfg.train.loss_impl)


def _dense_kd(ctx: BuildContext) -> Method:
    return Method(name="dense-kd", objective=_distill(ctx))


def _eslm_kd(score: str):
    def build(ctx: BuildContext) -> Method:
        m = ctx.cfg.method
        return Method(name=m.name, tokens=VaRSelector(score, m.alpha, m.standardize, ctx.n_domains, m.scope),
                      objective=_distill(ctx))
    return build


def _salt(ctx: BuildContext) -> Method:
    from eslm.objectives.kd_objective import Salt

    return Method(name="salt", objective=Salt(_distill(ctx), _ce(ctx), ctx.cfg.method.salt.kd_steps))


def _needs(section: str, key: str, what: str):
    def validate(cfg: Config) -> list[str]:
        if not getattr(getattr(cfg.method, section), key):
            return [f"method.{section}.{key}: {cfg.method.name} needs {what}; "
                    f"set method.{section}.{key}=RUN_DIR|CHECKPOINT"]
        return []
    return validate


def _greats_validate(cfg: Config) -> list[str]:
    out = []
    if cfg.method.scope != "micro":
        out.append("method.scope: greats selects rows, so only scope=micro applies")
    return out


for _spec in [
    MethodSpec("rho1", "Rho-1: keep the top 1-alpha tokens by excess loss against a frozen reference model",
               _rho1, _needs("rho1", "reference", "a reference model"), settings=(Rho1Section,)),
    MethodSpec("dense-kd", "dense distillation: lambda*KL(teacher||student) + (1-lambda)*CE on every token",
               _dense_kd, _needs("kd", "teacher", "a teacher model"), settings=(KDSection,)),
    MethodSpec("eslm-kd-entropy", "ESLM-KD: KD on the top 1-alpha tokens by the student's entropy",
               _eslm_kd("entropy"), _needs("kd", "teacher", "a teacher model"), settings=(KDSection,)),
    MethodSpec("eslm-kd-loss", "ESLM-KD: KD on the top 1-alpha tokens by the student's loss",
               _eslm_kd("loss"), _needs("kd", "teacher", "a teacher model"), settings=(KDSection,)),
    MethodSpec("salt", "SALT: dense KD for method.salt.kd_steps steps, then plain CE",
               _salt, _needs("kd", "teacher", "a teacher model"), settings=(KDSection, SaltSection)),
    MethodSpec("greats", "GREATS: greedy online row selection by ghost gradient inner products with a validation batch",
               _greats, _greats_validate, settings=(GreatsSection,)),
]:
    register(_spec)
