"""The LM-head backends: one protocol (``HeadBackend``: its five methods say what the training step, the drop-in
API and the FLOPs accounting need of the head), one registry, one dispatch.

``BACKENDS`` is the one list of implementations (``train.loss_impl``, ``selective_loss(impl=)``). Adding a backend
is one new module in ``eslm/ops/`` with a class that has the five methods, and one ``BackendSpec`` line below.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from eslm.errors import ConfigError
from eslm.ops import fused_head, naive_head  # noqa: F401  (torch alone: imported before any compiled call)
from eslm.ops.head_route import CACHED_ROUTES, ROUTE_CHOICES
from eslm.ops.token_stats import HeadOptions, HeadState, HeadWork, TokenStats

if TYPE_CHECKING:  # the gpu extra's backend, for the static check below only
    from eslm.ops import triton_head


@runtime_checkable
class HeadBackend(Protocol):
    """One implementation of the LM-head loss. Shapes: hidden (N, C), weight (V, C), targets (N,) int64, index
    (K,) int64 kept rows or None (every row kept); returned per-token values are fp32."""

    name: str

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, num_kept: int,
              need_scores: bool, need_entropy: bool) -> tuple[TokenStats | None, HeadState]:
        """The pass over all N rows (detached inputs, no gradient) before a ``kept_loss`` of ``num_kept`` rows:
        the statistics (None when ``need_scores`` is False and the backend formed none) and the state."""

    def kept_loss(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  index: torch.Tensor | None, state: HeadState | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the kept rows' CE, 0-dim fp32 with gradient to hidden and weight, exactly zero for a dropped row;
        their CE (K,) detached), from ``state`` (consumed) when ``score`` ran, else on its own."""

    def work(self, n: int, k: int, *, scored: bool, state: HeadState | None = None) -> HeadWork:
        """What ``score`` + ``kept_loss`` ran for n rows with k kept (``state``: the one that ran; without it,
        what would run)."""

    def token_stats(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    need_entropy: bool) -> TokenStats:
        """The scores alone, detached fp32 (evaluation, frozen reference models)."""

    def per_token_ce(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     index: torch.Tensor | None, *, lse: torch.Tensor | None = None) -> torch.Tensor:
        """CE (K,) fp32 of the kept rows with autograd to hidden and weight for any upstream gradient; ``lse``
        (N,): the scoring pass's, when one ran."""


@dataclass(frozen=True)
class BackendSpec:
    """One registry line: the name users give, where the class lives, what it is, the device types it runs on,
    and the package extra it needs (None: torch alone)."""

    name: str
    module: str
    cls: str
    summary: str
    devices: tuple[str, ...]
    extra: str | None = None


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec("fused", "eslm.ops.fused_head", "FusedHead",
                "chunked fp32 softmax, the head route chosen by a fixed rule (docs/fused_loss.md)",
                ("cpu", "cuda")),
    BackendSpec("naive", "eslm.ops.naive_head", "NaiveHead",
                "full (N, V) logits and F.cross_entropy, masked: the oracle", ("cpu", "cuda")),
    BackendSpec("triton", "eslm.ops.triton_head", "TritonHead",
                "bf16 logits cached by the scoring pass, Triton row kernels, the kept rows' backward only",
                ("cuda",), extra="gpu"),
)
NAMES = tuple(s.name for s in BACKENDS)
if TYPE_CHECKING:  # every registered class checked against HeadBackend by mypy (``_build`` looks them up by name)
    _REGISTERED: tuple[type[HeadBackend], ...] = (fused_head.FusedHead, naive_head.NaiveHead, triton_head.TritonHead)
IMPL_CHOICES = ("auto",) + NAMES
# what "auto" means per device type, in order of preference (the first whose extra is installed)
AUTO = {"cuda": ("triton", "fused"), "cpu": ("fused",)}


def spec(name: str) -> BackendSpec:
    for s in BACKENDS:
        if s.name == name:
            return s
    raise ConfigError(f"expected a head backend in {' | '.join(IMPL_CHOICES)}; found {name!r}; fix: use auto")


@functools.cache
def available(name: str) -> bool:
    """Whether the backend's module imports (its extra installed)."""
    try:
        sys.modules.get(spec(name).module) or importlib.import_module(spec(name).module)
    except ImportError:
        return False
    return True


def resolve(name: str, device_type: str | None = None) -> str:
    """The backend ``name`` stands for on ``device_type`` ("auto": the first available of ``AUTO``; None: CPU)."""
    if name != "auto":
        spec(name)
        return name
    return next(c for c in AUTO.get(device_type or "cpu", AUTO["cpu"]) if available(c))  # fused: torch alone


def option_problems(options: HeadOptions) -> list[str]:
    """What is wrong with a backend's options, one line each (config validation reports the same lines)."""
    out = []
    if options.route not in ROUTE_CHOICES:
        out.append(f"train.loss_route must be one of {' | '.join(ROUTE_CHOICES)}; found {options.route!r}; "
                   f"fix: train.loss_route=auto")
    elif options.route in CACHED_ROUTES and not options.cache_probs:
        out.append(f"train.loss_route={options.route} keeps the softmax, which train.loss_cache_probs=false "
                   f"forbids; fix: train.loss_cache_probs=true, or train.loss_route=auto")
    return out


@functools.lru_cache(maxsize=64)
def _build(name: str, options: HeadOptions) -> HeadBackend:
    s = spec(name)
    try:  # already imported: no import call (torch.compile does not trace importlib)
        mod = sys.modules.get(s.module) or importlib.import_module(s.module)
    except ImportError as e:
        raise ConfigError(f"the {name} head backend needs the '{s.extra}' extra ({e}); fix: pip install "
                          f"'eslm[{s.extra}]', or use the fused backend") from None
    return getattr(mod, s.cls)(options)


def backend(name: str = "auto", device_type: str | None = None, options: HeadOptions = HeadOptions()) -> HeadBackend:
    """The backend called ``name`` (resolved for ``device_type`` when "auto"), built with ``options``: the one
    place a backend name becomes an implementation. Backends are stateless (their state travels in
    ``HeadState``), so one instance per (name, options) serves every caller."""
    problems = option_problems(options)
    if problems:
        raise ConfigError("; ".join(problems))
    return _build(resolve(name, device_type), options)
