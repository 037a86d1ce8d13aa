"""The baselines as plug-ins of the shared step: Rho-1 as a token selector, GREATS as a row selector.

The maths lives beside: ``rho1.py`` (reference model, excess loss) and ``greats.py`` (ghost inner products,
greedy selection, FLOPs). These adapters only connect it to the step's interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eslm.baselines.greats import (DEFAULT_MEMORY_CAP_MB, ROUTES, GradientScoring, check_route, greats_pool_size,
                                   greats_select, scored_layer_shapes)
from eslm.baselines.rho1 import ReferenceModel, excess_loss
from eslm.contracts import ExtraWork, ModelPass
from eslm.data.batch import Batch
from eslm.errors import CheckpointError, ConfigError
from eslm.selection.rows import AllRows
from eslm.selection.selectors import VaRSelector
from eslm.settings import Section, setting


POOLS = ("floor", "pool")  # greats.greats_pool_size's modes


@dataclass(frozen=True)
class GreatsSection(Section):
    """``method.greats.*``: GREATS' settings (``GreatsRows`` below; the maths in ``greats.py``)."""

    key, help = "greats", "GREATS"

    val_fraction: float = setting(0.5, "GREATS validation batch size as a fraction of the micro-batch")
    pool: str = setting("floor", "GREATS budget 1-alpha of a micro-batch of B rows: floor (score the B rows, keep floor((1-alpha)B); default: GREATS' budget is the kept fraction of each batch and every method then consumes the same B rows per micro-batch) | pool (score ceil(B/(1-alpha)) rows, the B loader rows + extra training rows drawn by GREATS, keep B). The paper (0.9 of 12) does not say which; see eslm/baselines/greats.py")
    exclude_head: bool = setting(True, "GREATS: leave the tied LM head out of the gradient inner products")
    route: str = setting("flops", "GREATS per-layer inner products: flops (default: ghost or materialised per-sample gradients, whichever needs fewer FLOPs) | memory (ghost iff 2T^2 < the layer's weights, the old rule) | ghost | materialised; every route but ghost stays ghost where materialising exceeds method.greats.memory_cap_mb; see eslm/baselines/greats.py")
    memory_cap_mb: float = setting(DEFAULT_MEMORY_CAP_MB, "GREATS: most MiB of one layer's materialised fp32 per-sample gradients (candidate + validation rows x weights); above it the layer takes the ghost form")

    def problems(self) -> list[str]:
        out = []
        if self.pool not in POOLS:
            out.append(f"pool: expected one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.route not in ROUTES:
            out.append(f"route: expected one of {', '.join(ROUTES)}, got {self.route!r}")
        if not (0.0 < self.val_fraction <= 4.0):
            out.append(f"val_fraction: expected in (0, 4], got {self.val_fraction}")
        if not self.memory_cap_mb > 0:
            out.append(f"memory_cap_mb: expected > 0 MiB, got {self.memory_cap_mb}")
        return out


class Rho1Selector(VaRSelector):
    """Rho-1: keep the top 1-alpha tokens by excess loss = current loss - frozen reference loss (signed)."""

    def __init__(self, reference: ReferenceModel, alpha: float, seq_len: int, standardize: str = "none",
                 n_domains: int = 1, scope: str = "micro"):
        super().__init__("excess_loss", alpha, standardize, n_domains, scope)
        self.reference, self.seq_len = reference, seq_len

    def scores(self, stats, batch) -> torch.Tensor:
        """(B, T) fp32 excess loss; runs the reference forward (no grad, eval mode, never in DDP)."""
        return excess_loss(stats.loss.view(batch.x.shape), self.reference.token_loss(batch.x, batch.y))

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """The reference's forward over every token of the micro-batch; in the scope "step" also the scoring
        forward, in which ``scores`` runs the reference a second time over the same tokens."""
        ref = (ModelPass(self.reference.config, self.seq_len, tokens_seen),)
        if self.scope != "step":
            return ExtraWork(frozen_forwards=ref)
        return ExtraWork(frozen_forwards=ref, trained_forward_tokens=tokens_seen, repeated_frozen_forwards=ref)


class GreatsRows(AllRows):
    """GREATS: per micro-batch, score every candidate row by its gradient's alignment with a fresh validation
    batch (ghost inner products) and keep the greedy best rows for the update pass.

    ``route``, ``memory_cap_mb`` (``method.greats.route``, ``method.greats.memory_cap_mb``): each layer's form of
    the inner products (``greats.layer_route``); the FLOPs declared follow the forms actually taken.

    ``pool`` (``method.greats.pool``, see ``greats.greats_pool_size``) for a loader micro-batch of B rows:
      "floor" (default): the B loader rows are the candidates; keep floor(budget B).
      "pool":  the B loader rows plus ceil(B / budget) - B extra rows drawn from ``candidate_loader`` (an
               independent stream of training windows, same dataset, mixture, seq_len and rank, its own seed)
               are the candidates; keep B. The training sampler draws every window independently and
               uniformly (``eslm.data.loader``), so this pool has the distribution of ceil(B / budget) rows of
               one stream; the trainer's loader and the step are unchanged. The candidate loader's position is
               part of ``state_dict``, so a resumed run draws the same candidates.
    """

    def __init__(self, val_loader, *, alpha: float, exclude_head: bool, model_config, device,
                 pool: str = "floor", candidate_loader=None, route: str = "flops",
                 memory_cap_mb: float = DEFAULT_MEMORY_CAP_MB):
        self.val_loader, self.budget, self.pool = val_loader, 1.0 - alpha, pool
        self.candidate_loader = candidate_loader
        self.exclude_head, self.device = exclude_head, device
        self.layer_shapes = scored_layer_shapes(model_config, exclude_head)
        self.route, self.memory_cap_mb = route, memory_cap_mb
        self._last_shape = (0, 0, 0)  # (candidate rows, validation rows, T) of the last selection
        self._last_routes: list[str] = []  # the form each scored layer took in the last selection
        greats_pool_size(1, self.budget, pool)  # a bad budget, pool mode, route or cap fails at construction
        check_route(route, memory_cap_mb)

    def candidate_rows(self, batch_rows: int) -> int:
        return greats_pool_size(batch_rows, self.budget, self.pool)[0]

    def num_rows(self, batch_rows: int) -> int:
        return greats_pool_size(batch_rows, self.budget, self.pool)[1]

    def _candidates(self, batch):
        """The loader's rows followed by the extra candidates (pool mode)."""
        extra = self.candidate_rows(batch.x.shape[0]) - batch.x.shape[0]
        if extra == 0:
            return batch
        if self.candidate_loader is None or self.candidate_loader.micro_batch_size_seqs != extra:
            have = None if self.candidate_loader is None else self.candidate_loader.micro_batch_size_seqs
            raise ConfigError(f"GREATS pool mode: a micro-batch of {batch.x.shape[0]} rows needs a candidate "
                              f"loader of {extra} extra rows; found {have}; build it for train.micro_batch_size_seqs")
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
        """Scoring the last micro-batch's candidates (priced by ``greats.greats_extra_flops``): forward +
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
