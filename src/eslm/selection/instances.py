"""Instance-level selection by an early-exit pass: ESLM-H (the authors' revision of ESLM) and its random controls.

Per optimizer step ``select_step`` keeps the top ``1 - beta`` of ``A / (1 - beta)`` candidate micro-batches'
sequences by the early exit's mean entropy or loss (``exit_model``: the trained model's first ``k`` blocks, no
copy), over every rank, with no host read; the random controls keep as many uniformly at random. The design and
its reasons: docs/instances.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from eslm.contracts import NO_EXTRA_WORK, ExtraWork, Pass
from eslm.data.batch import Batch
from eslm.errors import ConfigError
from eslm.model.gpt import GPT, ModelConfig, Trunk
from eslm.ops.head_backend import backend
from eslm.ops.token_stats import HeadOptions
from eslm.selection import risk
from eslm.selection.rows import AllRows
from eslm.selection.selectors import all_gather, generator_state, load_generator
from eslm.settings import Section, setting


@dataclass(frozen=True)
class InstanceSection(Section):
    """``method.instance.*``: the instance-level selection's settings."""

    key, help = "instance", "instance-level selection by an early-exit pass (eslm-h-*, random-instance, random-h)"

    beta: float = setting(0.5, "VaR level over the step's sequences: the fraction of candidates dropped (keep the top "
                               "1-beta); the step reads train.grad_accum_steps / (1-beta) micro-batches")
    exit_layers: int = setting(1, "k: blocks of the early-exit pass (then the final norm and the tied head)")

    def problems(self) -> list[str]:
        out = []
        if not 0.0 <= self.beta < 1.0:
            out.append(f"beta: expected a value in [0, 1) (the fraction of sequences dropped), got {self.beta!r}")
        if self.exit_layers < 1:
            out.append(f"exit_layers: expected a positive number of blocks, got {self.exit_layers!r}")
        return out


def exit_model(model: GPT, k: int) -> GPT:
    """A GPT of ``k`` layers whose modules ARE the trained model's: no copy, no parameter of its own, no random
    draw (docs/instances.md, "The exit pass")."""
    if not 1 <= k <= model.config.n_layer:
        raise ConfigError(f"method.instance.exit_layers: expected 1..{model.config.n_layer} (the model's blocks), "
                          f"got {k}; fix: a smaller method.instance.exit_layers")
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded where FSDP sharded the model (no import here)
    if dtensor is not None and isinstance(model.head_weight, dtensor.DTensor):
        raise ConfigError("instance-level selection runs the trained model's first blocks outside its forward, where "
                          "FSDP keeps their parameters sharded; fix: distributed.fsdp=false (DDP)")
    with torch.device("meta"):
        view = GPT(replace(model.config, n_layer=k))
    t = model.transformer
    view.transformer = Trunk(dict(wte=t.wte, wpe=t.wpe, drop=t.drop, h=nn.ModuleList(list(t.h)[:k]), ln_f=t.ln_f))
    view.lm_head = model.lm_head
    return view


class InstanceRows(AllRows):
    """The row selector of ESLM-H (``score`` "entropy" | "loss": the exit's risk) and of the random controls
    (``score`` None). ``beta``: fraction of candidate rows dropped; ``exit_layers``: k; ``seed``: the random
    controls' generator (on ``device``)."""

    syncs_host = False

    def __init__(self, *, beta: float, exit_layers: int, score: str | None, model_config: ModelConfig, seq_len: int,
                 impl: str = "auto", chunk_size: int = 1024, seed: int = 0, device: torch.device | str = "cpu"):
        self.beta, self.k, self.score = risk.check_alpha(beta), exit_layers, score
        self.exit_config, self.seq_len = replace(model_config, n_layer=exit_layers), seq_len
        self.impl, self.chunk_size = impl, chunk_size
        self.generator = torch.Generator(device=device).manual_seed(seed) if score is None else None
        self._exit: tuple[GPT, GPT] | None = None  # (the trained model, its exit), built at the first step

    @property
    def _candidates_per_kept(self) -> Fraction:
        """1 / (1 - beta), exactly for the betas a config writes (0.5 -> 2, 0.2 -> 5/4)."""
        return 1 / (1 - Fraction(self.beta).limit_denominator(10**6))

    def candidate_batches(self, accum_steps: int) -> int:
        n = accum_steps * self._candidates_per_kept
        if n.denominator != 1:
            raise ConfigError(f"method.instance.beta={self.beta}: the step reads train.grad_accum_steps / (1 - beta) "
                              f"= {float(n):.4g} micro-batches of candidates, which must be a whole number; fix: a "
                              "beta whose 1 - beta divides train.grad_accum_steps (beta=0.5, or grad_accum_steps=4 "
                              "with beta=0.25)")
        return int(n)

    def select_step(self, model: torch.nn.Module, batches: list[Batch], world_size: int = 1) -> list[Batch]:
        x, y, domain = (torch.cat(parts) for parts in zip(*((b.x, b.y, b.domain) for b in batches)))
        rows = batches[0].x.shape[0]
        if self.generator is not None:  # the random controls: each rank its own uniform draw, no exit pass
            k = risk.num_kept(x.shape[0], self.beta)
            keep = torch.randperm(x.shape[0], generator=self.generator, device=self.generator.device)[:k]
            keep = keep.to(x.device).sort().values  # the loader's order
        else:
            scores = self.risk(cast(GPT, model), x, y)  # the trainer passes its GPT
            x, y, domain, scores = (all_gather(t, world_size) for t in (x, y, domain, scores))
            k = risk.num_kept(scores.numel(), self.beta)
            mine = k // world_size  # K = A B W on the trainer's path (candidate_batches)
            rank = dist.get_rank() if world_size > 1 else 0
            keep = risk.topk_index(scores, k).sort().values[rank * mine:(rank + 1) * mine]  # the loader's order
        return [Batch(x[i], y[i], domain[i]) for i in torch.split(keep, rows)]

    @torch.no_grad()
    def risk(self, model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(R,) fp32: each candidate row's mean exit statistic (``score``) over its T tokens."""
        if self._exit is None or self._exit[0] is not model:
            self._exit = (model, exit_model(model, self.k))
        hidden = self._exit[1](x).flatten(0, 1)
        head = backend(self.impl, hidden.device.type, HeadOptions(self.chunk_size))
        stats = head.token_stats(hidden, model.head_weight, y.reshape(-1), need_entropy=self.score == "entropy")
        return getattr(stats, str(self.score)).float().view(x.shape).mean(1)

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        if self.score is None:
            return NO_EXTRA_WORK
        tokens = tokens_seen * self._candidates_per_kept
        exact = int(tokens) if tokens.denominator == 1 else float(tokens)  # a mean over micro-batches may be fractional
        return ExtraWork(passes=(Pass(exact, self.exit_config, self.seq_len),))  # type: ignore[arg-type]

    def state_dict(self) -> dict:
        return {} if self.generator is None else generator_state(self.generator)

    def load_state_dict(self, sd: dict) -> None:
        if self.generator is not None:
            load_generator(self.generator, sd, "random-instance control")
