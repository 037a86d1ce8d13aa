"""GREATS (Wang et al., 2024): online selection of training rows by a greedy, validation-aligned utility.

Per step, with B candidate rows (sequences) z_1..z_B, a validation batch v_1..v_Bv and learning rate eta:

    g_i  = grad_theta loss_i         loss_i = mean over the row's T tokens of the next-token CE
    gbar = (1/Bv) sum_v g_v          the mean validation gradient
    u_i  = <g_i, gbar>               validation alignment of candidate i
    K_ij = <g_i, g_j>                train-train gradient inner products

GREATS approximates the drop of the validation loss after an SGD step on the subset S by a first-order term
per row and a pairwise second-order interaction (Hessian replaced by the identity). The set objective is

    F(S) = eta * sum_{i in S} u_i  -  eta^2 * sum_{i < j, i, j in S} K_ij                      (``greats_objective``)

and the greedy picks, k times, the unchosen row with the largest marginal gain

    F(S + {i}) - F(S) = eta * u_i - eta^2 * sum_{j in S} K_ij                              (``greedy_select``)

(ties to the lowest index). Greedy is what GREATS runs; it is not guaranteed to maximise F over all
k-subsets (F is neither monotone nor submodular when some K_ij < 0). The tests compare it with brute force.

Gradients: only the weights (and biases) of ``nn.Linear`` layers enter the inner products, as in GREATS.
For a layer with inputs a_i (T, in) and output gradients d_i (T, out) of loss_i, the per-sample weight
gradient is G_i = d_i^T a_i (out, in) and

    <G_i, G_v> = sum_t sum_s (a_i,t . a_v,s) (d_i,t . d_v,s)          (the "ghost" inner product)

(+1 inside the first factor for a bias), or from materialised per-sample gradients: the same numbers up to
reassociation (``layer_route``). Cost model, ``method.greats.pool`` and ``exclude_head``: docs/flops.md.

The model's parameter ``.grad`` is never touched (``torch.autograd.grad`` to a Linear output), and each layer's
inner products are computed inside the backward as soon as its output gradient arrives, which is then dropped:
peak memory is the activations of one forward on B + Bv rows plus one layer's products.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eslm import seeds
from eslm.contracts import BACKWARD, ExtraWork, Pass
from eslm.data.batch import Batch
from eslm.data.loader import TrainLoader
from eslm.errors import CheckpointError, ConfigError
from eslm.ops.head_backend import backend
from eslm.ops.token_stats import HeadOptions
from eslm.selection.risk import FLOOR_EPS
from eslm.selection.rows import AllRows
from eslm.settings import Section, setting

# ---------------------------------------------------------------------------------------------------------
# capturing layer inputs and output gradients
# ---------------------------------------------------------------------------------------------------------


def scored_linears(model: nn.Module, exclude_head: bool = True) -> list[tuple[str, nn.Linear]]:
    """The Linear modules whose weights enter the inner products (``lm_head`` last, only if included)."""
    out = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    if not exclude_head:
        head = model.get_submodule("lm_head")
        assert isinstance(head, nn.Linear)
        out.append(("lm_head", head))
    return out


def scored_layer_shapes(cfg, exclude_head: bool = True) -> list[tuple[int, int, bool]]:
    """(in, out, has_bias) of the scored Linears of a GPT with ModelConfig ``cfg``, without building it."""
    C, bias = cfg.n_embd, cfg.bias
    block = [(C, 3 * C, bias), (C, C, bias), (C, 4 * C, bias), (4 * C, C, bias)]
    shapes = block * cfg.n_layer
    return shapes if exclude_head else shapes + [(C, cfg.vocab_size, False)]


def _per_sample_loss(model, hidden: torch.Tensor, y: torch.Tensor, exclude_head: bool, impl: str) -> torch.Tensor:
    """(N,) mean next-token CE per row, differentiable w.r.t. the hidden states (and the hooked head)."""
    N, T, C = hidden.shape
    if exclude_head:
        # The head weight is detached: only activation gradients are wanted, never the head's weight gradient.
        ce = backend(impl, hidden.device.type, HeadOptions()).per_token_ce(
            hidden.reshape(N * T, C), model.head_weight.detach(), y.reshape(-1), None)
    else:
        ce = F.cross_entropy(model.lm_head(hidden).float().reshape(N * T, -1), y.reshape(-1), reduction="none")
    return ce.view(N, T).mean(1)


def stream_linear_io(model: nn.Module, x: torch.Tensor, y: torch.Tensor, on_layer, *, exclude_head: bool = True,
                     impl: str = "auto") -> torch.Tensor:
    """Forward x (N, T) and backward sum_i loss_i; call ``on_layer(name, a, d, has_bias)`` for every scored
    Linear as soon as its output gradient d (N, T, out) is known (a (N, T, in) its input, both detached,
    the model's dtype). Returns the per-row loss (N,) fp32.

    Because rows never interact in a GPT (causal attention within a row, LayerNorm per token), the gradient
    of sum_i loss_i with respect to row n's layer output is exactly d loss_n / d out_n. The backward runs
    through ``torch.autograd.grad`` to the first scored layer's output only, so no parameter's ``.grad``
    is written and at most one layer's d is alive at a time (a is the input the Linear saves for its own
    backward anyway). The model's parameters must require grad (they do during training).
    """
    mods = scored_linears(model, exclude_head)
    outs, fired = [], set()

    def forward_hook(name):
        def fn(module, inputs, output):
            a, bias = inputs[0].detach(), module.bias is not None

            def on_grad(d):
                fired.add(name)
                on_layer(name, a, d.detach(), bias)  # returns None: the gradient flows on unchanged

            output.register_hook(on_grad)
            outs.append(output)
        return fn

    handles = [m.register_forward_hook(forward_hook(n)) for n, m in mods]
    try:
        with torch.enable_grad():
            loss = _per_sample_loss(model, model(x), y, exclude_head, impl)
            torch.autograd.grad(loss.sum(), outs[:1])  # every scored layer lies between outs[0] and the loss
    finally:
        for h in handles:
            h.remove()
    for n, m in mods:  # a layer the loss does not reach has zero gradient
        if n not in fired:
            on_layer(n, None, None, m.bias is not None)
    return loss.detach().float()


# ---------------------------------------------------------------------------------------------------------
# per-layer inner products
# ---------------------------------------------------------------------------------------------------------


LAYER_ROUTES = ("flops", "memory", "ghost", "materialised")  # method.greats.route (layer_route); head routes: ops.head_route.ROUTES
GHOST, MATERIALISED = "ghost", "materialised"  # the form a layer takes (info["layer_modes"])
DEFAULT_MEMORY_CAP_MB = 1024.0  # method.greats.memory_cap_mb (what layers need: docs/flops.md)
_MB = 2.0 ** 20


def layer_flops(T: int, n_in: int, n_out: int, has_bias: bool, n_x: int, n_rows: int) -> tuple[float, float]:
    """(ghost, materialised) FLOPs of one layer's (n_x, n_rows) inner products (docs/flops.md's cost model)."""
    pairs = n_x * n_rows
    ghost = pairs * (2.0 * T * T * (n_in + n_out) + 2.0 * T * T + (T * T if has_bias else 0))
    mat = n_rows * (2.0 * T * n_in * n_out + (T * n_out if has_bias else 0)) + pairs * 2.0 * n_out * (n_in + has_bias)
    return ghost, mat


def layer_memory_bytes(n_in: int, n_out: int, has_bias: bool, n_rows: int) -> float:
    """Bytes of the materialised route's per-sample gradients: n_rows x out (in + bias) fp32 numbers."""
    return 4.0 * n_rows * n_out * (n_in + int(has_bias))


def layer_route(T: int, n_in: int, n_out: int, has_bias: bool = False, route: str = "flops", n_x: int = 1,
                n_rows: int = 1, memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB) -> str:
    """'ghost' or 'materialised' for one layer scoring n_x rows against n_rows rows.

    The rules of ``method.greats.route`` and the ``memory_cap_mb`` fallback: docs/flops.md.
    """
    if route == "ghost" or layer_memory_bytes(n_in, n_out, has_bias, n_rows) > memory_cap_mb * _MB:
        return GHOST
    if route == "memory":
        return GHOST if 2 * T * T < n_out * (n_in + int(has_bias)) else MATERIALISED
    if route == "flops":
        ghost, mat = layer_flops(T, n_in, n_out, has_bias, n_x, n_rows)
        return GHOST if ghost < mat else MATERIALISED
    return MATERIALISED


def ghost_inner_products(a_x, d_x, a_y, d_y, has_bias: bool = False) -> torch.Tensor:
    """(Nx, Ny) fp32 <G_i, G_v> = sum_{t,s} (a_i,t . a_v,s + bias) (d_i,t . d_v,s), one row i at a time.

    a_x (Nx, T, in), d_x (Nx, T, out), a_y (Ny, S, in), d_y (Ny, S, out). Peak extra memory: 2 Ny T S.
    """
    out = torch.empty(a_x.shape[0], a_y.shape[0], dtype=torch.float32, device=a_x.device)
    for i in range(a_x.shape[0]):
        A = a_y @ a_x[i].t()  # (Ny, S, T): a_v,s . a_i,t
        if has_bias:
            A = A + 1.0
        D = d_y @ d_x[i].t()  # (Ny, S, T): d_v,s . d_i,t
        out[i] = (A * D).sum((1, 2))
    return out


def per_sample_grads(a: torch.Tensor, d: torch.Tensor, has_bias: bool = False) -> torch.Tensor:
    """(N, out*in [+ out]) fp32: G_n = d_n^T a_n flattened, with the bias gradient sum_t d_n,t appended."""
    G = torch.einsum("nto,nti->noi", d, a).flatten(1)
    return torch.cat([G, d.sum(1)], 1) if has_bias else G


def layer_inner_products(a: torch.Tensor, d: torch.Tensor, has_bias: bool, n_x: int, route: str = "flops",
                         memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB) -> tuple[torch.Tensor, str]:
    """(n_x, N) inner products between the first n_x rows of one layer's inputs a (N, T, in) and output gradients
    d (N, T, out) and all its N rows; and the route taken (``layer_route``)."""
    m = layer_route(a.shape[1], a.shape[2], d.shape[2], has_bias, route, n_x, a.shape[0], memory_cap_mb)
    if m == GHOST:
        return ghost_inner_products(a[:n_x], d[:n_x], a, d, has_bias), m
    G = per_sample_grads(a, d, has_bias)  # form every row's gradient once
    return G[:n_x] @ G.t(), m


# ---------------------------------------------------------------------------------------------------------
# the greedy
# ---------------------------------------------------------------------------------------------------------


def greats_objective(subset: Sequence[int], u: torch.Tensor, K: torch.Tensor, eta: float) -> float:
    """F(S) = eta * sum_{i in S} u_i - eta^2 * sum_{i<j in S} K_ij (float64 arithmetic)."""
    idx = torch.as_tensor(list(subset), dtype=torch.long)
    u, K = u.double(), K.double()
    Ks = K[idx][:, idx]
    pairs = (Ks.sum() - Ks.diagonal().sum()) / 2  # each unordered pair once, no self terms
    return float(eta * u[idx].sum() - eta * eta * pairs)


def greedy_select(u: torch.Tensor, K: torch.Tensor, k: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy maximisation of ``greats_objective``: (pick order (k,) int64, marginal gains (k,) float64).

    u (B,) alignments, K (B, B) symmetric train Gram; each pick is O(B).
    """
    B = u.shape[0]
    if not 1 <= k <= B:
        raise ConfigError(f"GREATS keeps k rows of B candidates: expected 1 <= k <= {B}, found k = {k}")
    gain = eta * u.double().clone()
    K = K.double()
    taken = torch.zeros(B, dtype=torch.bool, device=u.device)
    order, gains = [], []
    for _ in range(k):
        i = int(torch.argmax(gain.masked_fill(taken, -math.inf)))  # first maximum on ties
        order.append(i)
        gains.append(gain[i].clone())
        taken[i] = True
        gain -= eta * eta * K[:, i]
    return torch.tensor(order, dtype=torch.long, device=u.device), torch.stack(gains)


# ---------------------------------------------------------------------------------------------------------
# the selection step
# ---------------------------------------------------------------------------------------------------------


def greats_select(model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, val_x: torch.Tensor,
                  val_y: torch.Tensor, *, lr: float, k: int, exclude_head: bool = True, route: str = "flops",
                  memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB, impl: str = "auto") -> tuple[torch.Tensor, dict]:
    """Choose k of the B rows of (train_x, train_y) (B, T) int64 by GREATS' greedy (module doc).

    val_x, val_y (Bv, T): the validation batch; lr: the current learning rate eta; route, memory_cap_mb: each
    layer's form (``layer_route``: the selection is the same for every route up to floating-point reassociation).
    Returns (kept row indices (k,) int64, ascending; info) with info =
      "val_scores" (B,) fp32 u_i = <g_i, gbar_val>; "gram" (B, B) fp32 K; "pick_order" (k,);
      "objective" F(S); "layer_modes" {name: ghost|materialised|unused}; "row_loss" (B,), "val_row_loss" (Bv,)
      per-row mean CE.
    Parameter ``.grad`` is left exactly as it was.
    """
    B = train_x.shape[0]
    if val_x.shape[1] != train_x.shape[1]:
        raise ConfigError(f"GREATS validation rows must have the training length T = {train_x.shape[1]}, "
                          f"found {val_x.shape[1]}; build the validation stream with the same seq_len")
    x, y = torch.cat([train_x, val_x]), torch.cat([train_y, val_y])
    total = torch.zeros(B, x.shape[0], dtype=torch.float32, device=x.device)
    modes = {}

    def accumulate(name, a, d, bias):  # runs inside the backward, one layer at a time
        if a is None:
            modes[name] = "unused"
            return
        ip, modes[name] = layer_inner_products(a.float(), d.float(), bias, B, route, memory_cap_mb)
        total.add_(ip)

    loss = stream_linear_io(model, x, y, accumulate, exclude_head=exclude_head, impl=impl)
    K, u = total[:, :B], total[:, B:].mean(1)  # <g_i, mean_v g_v> = mean_v <g_i, g_v>
    order, _ = greedy_select(u, K, k, lr)
    names = [n for n, _ in scored_linears(model, exclude_head)]
    return torch.sort(order).values, {
        "layer_modes": {n: modes[n] for n in names}, "row_loss": loss[:B], "val_row_loss": loss[B:], "val_scores": u,
        "gram": K, "pick_order": order, "objective": greats_objective(order.tolist(), u, K, lr)}


# ---------------------------------------------------------------------------------------------------------
# budget and FLOPs
# ---------------------------------------------------------------------------------------------------------


def greats_pool_size(B: int, budget: float, mode: str = "floor") -> tuple[int, int]:
    """(candidate rows scored, rows kept) for a micro-batch of B rows and a selection budget in (0, 1].

    "floor" (default): score the B rows, keep floor(budget * B) (at least 1). "pool": score ceil(B / budget), keep
    B. Both readings and why floor is the default: docs/flops.md, "GREATS' budget".
    """
    # budget * B in floating point: 0.9 * 10 = 9.000000000000002 must floor to 9, 0.7 * 10 = 6.999999999999999 to 7
    if mode == "pool":
        return math.ceil(B / budget - FLOOR_EPS), B
    return B, max(1, math.floor(budget * B + FLOOR_EPS))


def greats_val_rows(B: int, val_fraction: float) -> int:
    """Validation rows per micro-batch of B rows: round(method.greats.val_fraction * B), at least 1."""
    return max(1, round(val_fraction * B))


def layer_routes(layer_shapes: Sequence[tuple[int, int, bool]], B: int, Bv: int, T: int, route: str = "flops",
                 memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB) -> list[str]:
    """The form ``greats_select`` takes per layer (``layer_route``): B candidate rows against B + Bv rows."""
    return [layer_route(T, i, o, bias, route, B, B + Bv, memory_cap_mb) for i, o, bias in layer_shapes]


# ---------------------------------------------------------------------------------------------------------
# GREATS' cost: its scoring per micro-batch (declared to the FLOPs ledger as ``GradientScoring``) and its cost in
# CLM micro-batches for a config. ``fm`` is the trained model's ``eslm.flops.FlopsModel`` (its per-token FLOPs).
# ---------------------------------------------------------------------------------------------------------


def greats_extra_flops(forward_per_token: float, backward_per_token: float,
                       layer_shapes: Sequence[tuple[int, int, bool]], B: int, Bv: int, T: int, *,
                       routes: Sequence[str]) -> float:
    """FLOPs GREATS spends per micro-batch beyond the update pass on the kept rows (docs/flops.md), each layer
    in the form it took (``routes``: ``greats_select``'s info["layer_modes"], or ``layer_routes``)."""
    if len(routes) != len(layer_shapes):
        raise ValueError(f"expected one route per scored layer ({len(layer_shapes)}), found {len(routes)}")
    inner = 0.0
    for (n_in, n_out, bias), r in zip(layer_shapes, routes):
        ghost, mat = layer_flops(T, n_in, n_out, bias, B, B + Bv)
        inner += {GHOST: ghost, MATERIALISED: mat, "unused": 0.0}[r]
    tokens = (B + Bv) * T
    return tokens * forward_per_token + tokens * backward_per_token * 0.5 + inner


@dataclass(frozen=True)
class GradientScoring:
    """What one micro-batch's selection ran, for the FLOPs ledger (an ``eslm.contracts.PricedWork``): a forward
    and an activation-gradient backward of ``rows + val_rows`` rows of ``seq_len`` tokens, then the inner
    products of ``rows`` candidate rows against ``rows + val_rows`` rows in every scored Linear layer,
    ``layer_shapes`` (in, out, has_bias) each in the form it took, ``routes``."""

    rows: int
    val_rows: int
    seq_len: int
    layer_shapes: tuple[tuple[int, int, bool], ...]
    routes: tuple[str, ...]

    def passes(self) -> tuple[Pass, ...]:
        """The passes its price includes: the forward and the activation-gradient backward of its rows."""
        tokens = (self.rows + self.val_rows) * self.seq_len
        return Pass(tokens), Pass(tokens, direction=BACKWARD)

    def flops(self, fm) -> float:
        """Its FLOPs at the trained model's per-token costs (the same in both conventions)."""
        return greats_extra_flops(fm.forward_per_token, fm.backward_per_token, self.layer_shapes, self.rows,
                                  self.val_rows, self.seq_len, routes=self.routes)


def greats_micro_batch_cost(fm, layer_shapes: Sequence[tuple[int, int, bool]], B: int, Bv: int, *,
                            budget: float = 0.9, pool: str = "floor", route: str = "flops",
                            memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB) -> dict:
    """GREATS' FLOPs per micro-batch in CLM micro-batches (of B rows): {"paper": r, "executed": r, "routes": [...]}.
    It trains every token of its k kept rows and scores n + Bv rows (``greats_pool_size``,
    ``greats_extra_flops``), which both conventions count, so "paper" and "executed" are equal."""
    T = fm.seq_len
    n, k = greats_pool_size(B, budget, pool)
    routes = layer_routes(layer_shapes, n, Bv, T, route, memory_cap_mb)
    extra = greats_extra_flops(fm.forward_per_token, fm.backward_per_token, layer_shapes, n, Bv, T, routes=routes)
    r = (fm.train_per_token * k * T + extra) / (fm.train_per_token * B * T)
    return {"paper": r, "executed": r, "routes": routes}


def greats_cost_ratio(cfg, fm, model_config) -> dict:
    """``greats_micro_batch_cost`` (= per optimizer step) for an eslm Config's micro-batch, alpha and method.greats.*
    keys; fm: ``eslm.config.training_flops_model(cfg)``, model_config: ``eslm.config.model_config_for(cfg)``."""
    g, B = cfg.method.greats, cfg.train.micro_batch_size_seqs
    return greats_micro_batch_cost(fm, scored_layer_shapes(model_config, g.exclude_head), B,
                                   greats_val_rows(B, g.val_fraction), budget=1.0 - cfg.method.alpha, pool=g.pool,
                                   route=g.route, memory_cap_mb=g.memory_cap_mb)


# ---------------------------------------------------------------------------------------------------------
# the plug-in of the step: GREATS' settings and its row selector
# ---------------------------------------------------------------------------------------------------------


POOLS = ("floor", "pool")  # greats_pool_size's modes


@dataclass(frozen=True)
class GreatsSection(Section):
    """``method.greats.*``: GREATS' settings (``GreatsRows`` below reads them; the maths above)."""

    key, help = "greats", "GREATS"

    val_fraction: float = setting(0.5, "GREATS validation batch size as a fraction of the micro-batch")
    pool: str = setting("floor", "GREATS budget 1-alpha of a micro-batch of B rows: floor (score the B rows, keep floor((1-alpha)B); default: GREATS' budget is the kept fraction of each batch and every method then consumes the same B rows per micro-batch) | pool (score ceil(B/(1-alpha)) rows, the B loader rows + extra training rows drawn by GREATS, keep B). The paper (0.9 of 12) does not say which; see eslm/baselines/greats.py")
    exclude_head: bool = setting(True, "GREATS: leave the tied LM head out of the gradient inner products")
    route: str = setting("flops", "GREATS per-layer inner products: flops (default: ghost or materialised per-sample gradients, whichever needs fewer FLOPs) | memory (ghost iff 2T^2 < the layer's weights: the form that keeps less in memory) | ghost | materialised; every route but ghost stays ghost where materialising exceeds method.greats.memory_cap_mb; see eslm/baselines/greats.py")
    memory_cap_mb: float = setting(DEFAULT_MEMORY_CAP_MB, "GREATS: most MiB of one layer's materialised fp32 per-sample gradients (candidate + validation rows x weights); above it the layer takes the ghost form")

    def problems(self) -> list[str]:
        out = []
        if self.pool not in POOLS:
            out.append(f"pool: expected one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.route not in LAYER_ROUTES:
            out.append(f"route: expected one of {', '.join(LAYER_ROUTES)}, got {self.route!r}")
        if not (0.0 < self.val_fraction <= 4.0):
            out.append(f"val_fraction: expected in (0, 4], got {self.val_fraction}")
        if not self.memory_cap_mb > 0:
            out.append(f"memory_cap_mb: expected > 0 MiB, got {self.memory_cap_mb}")
        return out


class GreatsRows(AllRows):
    """GREATS: per micro-batch, score every candidate row by its gradient's alignment with a fresh validation
    batch and keep the greedy best rows for the update pass.

    The validation batches are held-out TRAINING data (docs/data.md), never the split the run is evaluated on.

    ``pool`` mode (``greats_pool_size``) draws its extra candidates from ``candidate_loader``, an independent
    stream of training windows (the sampler draws every window independently and uniformly, so the pool has
    the distribution of ceil(B / budget) rows of one stream); its position is part of ``state_dict``.
    """

    syncs_host = True  # the greedy loop reads each chosen row's index (greedy_select)

    def __init__(self, g: GreatsSection, *, alpha: float, micro_batch_size_seqs: int, seed: int,
                 val_loader_factory, model_config, device):
        """GREATS as a run configures it (``g``: method.greats.*; ``val_loader_factory`` as ``BuildContext``'s)."""
        B, self.budget = micro_batch_size_seqs, 1.0 - alpha  # GREATS keeps 1 - alpha of the rows
        self.pool, self.route, self.memory_cap_mb, self.exclude_head = g.pool, g.route, g.memory_cap_mb, g.exclude_head
        self.device, self.layer_shapes = device, scored_layer_shapes(model_config, g.exclude_head)
        self.val_loader = val_loader_factory(greats_val_rows(B, g.val_fraction))
        extra = greats_pool_size(B, self.budget, g.pool)[0] - B
        self.candidate_loader = candidate_loader(self.val_loader, extra, seed) if extra else None
        self._last_shape = (0, 0, 0)  # (candidate rows, validation rows, T) of the last selection
        self._last_routes: list[str] = []  # the form each scored layer took in the last selection

    def candidate_rows(self, batch_rows: int) -> int:
        return greats_pool_size(batch_rows, self.budget, self.pool)[0]

    def num_rows(self, batch_rows: int) -> int:
        return greats_pool_size(batch_rows, self.budget, self.pool)[1]

    def _candidates(self, batch):
        """The loader's rows followed by the extra candidates (pool mode)."""
        extra = self.candidate_rows(batch.x.shape[0]) - batch.x.shape[0]
        if extra == 0:
            return batch
        assert self.candidate_loader is not None and self.candidate_loader.micro_batch_size_seqs == extra
        more = self.candidate_loader.next_batch().to(batch.x.device)
        return Batch(torch.cat([batch.x, more.x]), torch.cat([batch.y, more.y]),
                     torch.cat([batch.domain, more.domain]))

    def select(self, model, batch, step: int, lr: float):
        k = self.num_rows(batch.x.shape[0])
        pool = self._candidates(batch)
        val = self.val_loader.next_batch().to(self.device)
        with torch.autocast(device_type=self.device.type, enabled=False):
            index, info = greats_select(model, pool.x, pool.y, val.x, val.y, lr=lr, k=k,
                                        exclude_head=self.exclude_head, route=self.route,
                                        memory_cap_mb=self.memory_cap_mb)
        self._last_shape = (pool.x.shape[0], val.x.shape[0], pool.x.shape[1])
        self._last_routes = list(info["layer_modes"].values())
        return pool.rows(index.to(pool.x.device)), info

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Scoring the last micro-batch's candidates (priced by ``greats_extra_flops``): forward +
        activation backward on candidates + validation rows, and the inner products in the form each layer
        took. The update pass on the kept rows is the trainer's ``tokens_seen``; the validation rows' forward
        is inside this figure, hence no extra tokens."""
        n, Bv, T = self._last_shape
        if n == 0:
            return ExtraWork()
        return ExtraWork(priced=(GradientScoring(n, Bv, T, tuple(self.layer_shapes),
                                                           tuple(self._last_routes)),))

    def state_dict(self) -> dict:
        sd = {"val_loader": self.val_loader.state_dict()}
        if self.candidate_loader is not None:
            sd["candidate_loader"] = self.candidate_loader.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if ("candidate_loader" in sd) != (self.candidate_loader is not None):
            was = "pool" if "candidate_loader" in sd else "floor"
            raise CheckpointError(f"expected a GREATS checkpoint of method.greats.pool={self.pool}; found one of "
                                  f"pool={was}; fix: resume with method.greats.pool={was}")
        self.val_loader.load_state_dict(sd["val_loader"])
        if self.candidate_loader is not None:
            self.candidate_loader.load_state_dict(sd["candidate_loader"])


def candidate_loader(val_loader: TrainLoader, rows: int, seed: int) -> TrainLoader:
    """GREATS pool mode's extra candidates: an independent stream of TRAINING windows (without the held-out tail)
    with the validation stream's dataset, mixture (the training mixture), seq_len and rank."""
    v = val_loader
    return TrainLoader(v.dataset, seq_len=v.seq_len, micro_batch_size_seqs=rows, weights=v.weights,
                       seed=seeds.greats_candidates(seed), rank=v.rank, world_size=v.world_size, split="train",
                       part="fit")
