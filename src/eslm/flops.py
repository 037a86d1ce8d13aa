"""FLOPs accounting: the PaLM estimate, the paper's convention, and what was actually executed (docs/flops.md
derives every formula here and checks them against ``torch.utils.flop_counter``).

Pure arithmetic on Python numbers (no torch, no model instantiation); one multiply-add counts as 2 FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from eslm import metrics as M
from eslm.contracts import EXECUTED, FORWARD, PAPER, ExtraWork
from eslm.errors import ConfigError
from eslm.model.gpt import ModelConfig, preset

COUNT_PER = ("global", "micro")
COUNTER_KEYS = (M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.FLOPS_DENSE)


def count_params(cfg: ModelConfig) -> int:
    """N of ``GPT(cfg).num_params()``, computed from the config alone (the position embedding
    excluded, the tied embedding counted once)."""
    C, L = cfg.n_embd, cfg.n_layer
    per_layer = 12 * C * C + 2 * C  # matmul weights + ln_1, ln_2 gains
    final = C  # ln_f gain
    if cfg.bias:
        per_layer += (3 * C + C + 4 * C + C) + 2 * C  # linear biases + ln_1, ln_2 biases
        final += C  # ln_f bias
    return cfg.vocab_size * C + L * per_layer + final


@dataclass(frozen=True)
class FlopsModel:
    """Per-token FLOPs of one model at one training sequence length (all properties: FLOPs per token)."""

    n_params: int  # N without the position embedding (tied embedding counted once), as nanoGPT counts
    n_layer: int
    n_head: int
    head_dim: int
    seq_len: int  # T: tokens per training sequence (attention span)
    n_embd: int
    vocab_size: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, seq_len: int) -> FlopsModel:
        """The FlopsModel of ``GPT(cfg)`` trained on sequences of ``seq_len`` tokens (N computed analytically)."""
        if not 1 <= int(seq_len) <= cfg.block_size:
            raise ConfigError(f"seq_len must be in [1, block_size={cfg.block_size}]; found {seq_len}; "
                              f"fix: set data.seq_len <= model.block_size")
        return cls(n_params=count_params(cfg), n_layer=cfg.n_layer, n_head=cfg.n_head,
                   head_dim=cfg.n_embd // cfg.n_head, seq_len=int(seq_len), n_embd=cfg.n_embd,
                   vocab_size=cfg.vocab_size)

    @property
    def attention_per_token(self) -> float:
        """12 L H Q T: attention scores and weighted values, forward + backward, all T positions."""
        return 12.0 * self.n_layer * self.n_head * self.head_dim * self.seq_len

    @property
    def train_per_token(self) -> float:
        """PaLM: 6N + 12 L H Q T (forward + backward)."""
        return 6.0 * self.n_params + self.attention_per_token

    @property
    def forward_per_token(self) -> float:
        """2N + 4 L H Q T: one third of a training step."""
        return self.train_per_token / 3.0

    @property
    def backward_per_token(self) -> float:
        """4N + 8 L H Q T: two thirds of a training step (LM head backward included)."""
        return 2.0 * self.train_per_token / 3.0

    @property
    def head_forward_per_token(self) -> float:
        """2 C V: the LM-head matmul hidden (C,) @ W^T (C, V)."""
        return 2.0 * self.n_embd * self.vocab_size

    @property
    def head_backward_per_token(self) -> float:
        """4 C V: grad wrt the hidden state (dlogits @ W) + grad wrt W (dlogits^T @ hidden)."""
        return 4.0 * self.n_embd * self.vocab_size


@dataclass
class StepFlops:
    """FLOPs of one micro-batch on one rank under the three conventions."""

    paper: float
    executed: float
    dense: float


def step_flops(fm: FlopsModel, *, tokens_seen: float, tokens_kept: float, head_backward_tokens: float,
               head_recompute_tokens: float = 0, extra_forward_tokens: float = 0,
               extra_flops_paper: float = 0.0, extra_flops_executed: float = 0.0) -> StepFlops:
    """The three FLOPs counts of one micro-batch on one rank.

    tokens_seen:           tokens through the forward of the trained model (B*T)
    tokens_kept:           tokens whose loss is backpropagated (the realised K)
    head_backward_tokens:  rows whose LM-head backward ran: K for the fused loss, tokens_seen for a masked loss
    head_recompute_tokens: rows whose logits the fused loss recomputed in its backward (0 if cached); negative
                           for rows whose head forward never ran (the random control's dropped rows)
    extra_forward_tokens:  further forward tokens of the trained model (the selection scope "step"'s scoring forward)
    extra_flops_paper / extra_flops_executed: FLOPs outside the trained model (reference / teacher forwards,
                           e.g. ``frozen_forward_flops``), as counted by each convention
    """
    if not 0 <= tokens_kept <= tokens_seen or not 0 <= head_backward_tokens <= tokens_seen:
        raise ValueError(f"expected 0 <= tokens_kept, head_backward_tokens <= tokens_seen={tokens_seen}; "
                         f"found tokens_kept={tokens_kept}, head_backward_tokens={head_backward_tokens}")
    fwd, bwd = fm.forward_per_token, fm.backward_per_token
    dense = fm.train_per_token * tokens_seen
    # The paper: forward on every token, backward as if it scaled with the kept fraction.
    paper = fwd * tokens_seen + bwd * tokens_kept + extra_flops_paper
    # Executed: the trunk backward runs for every token (attention mixes positions, so a dropped token's
    # activations still receive gradient from kept ones); only the head backward can be restricted to rows.
    trunk_bwd = bwd - fm.head_backward_per_token
    executed = (fwd * (tokens_seen + extra_forward_tokens)
                + trunk_bwd * tokens_seen
                + fm.head_backward_per_token * head_backward_tokens
                + fm.head_forward_per_token * head_recompute_tokens
                + extra_flops_executed)
    return StepFlops(paper=paper, executed=executed, dense=dense)


def frozen_forward_flops(config: ModelConfig, seq_len: int, tokens: int) -> float:
    """FLOPs of a forward pass of a frozen model (``ModelConfig`` ``config``) over ``tokens`` tokens of
    sequences of ``seq_len`` tokens: Rho-1's reference, a KD teacher."""
    return FlopsModel.from_config(config, seq_len).forward_per_token * tokens


def extra_flops(work, fm: FlopsModel) -> tuple[float, float, int]:
    """(paper FLOPs, executed FLOPs, extra forward tokens of the trained model counted by the executed convention
    alone) of declared extra work (an iterable of ``eslm.contracts.ExtraWork``) on one micro-batch: each pass
    (``eslm.contracts.Pass``) priced in the conventions that count it; ``fm``: the trained model's, which the
    trained model's passes and the work a component prices itself (``ExtraWork.priced``) need."""
    paper = executed = 0.0
    tokens = 0
    for w in work:
        f = 0.0
        for priced in w.priced:
            f = f + priced.flops(fm)
        only_paper = only_executed = 0.0
        for p in w.passes:
            if p.model is None and p.counted_by == (EXECUTED,) and p.direction == FORWARD:
                tokens += p.tokens  # step_flops prices them beside the trained model's own forward
                continue
            cost = (frozen_forward_flops(p.model, p.seq_len, p.tokens) if p.model is not None else
                    (fm.forward_per_token if p.direction == FORWARD else fm.backward_per_token)
                    * p.tokens)
            if PAPER in p.counted_by and EXECUTED in p.counted_by:
                f = cost + f
            elif PAPER in p.counted_by:
                only_paper = only_paper + cost
            else:
                only_executed = only_executed + cost
        paper, executed = paper + f + only_paper, executed + f + only_executed
    return paper, executed, tokens


def micro_batch_flops(fm: FlopsModel, method, *, tokens_seen: int, tokens_kept: int, step_work: ExtraWork) -> StepFlops:
    """The three FLOPs counts of one micro-batch of ``method`` (an ``eslm.methods.Method``) on one rank: the
    trained model's pass from the token counts, the head's work as the objective reports it
    (``head_work``), every component's declared ``extra_work`` and the step's own (``step_work``: what
    ``eslm.train.step.step_work`` declares, e.g. the selection scope "step"'s scoring forward)."""
    head_bwd, head_recompute = method.objective.head_work(tokens_seen, tokens_kept,
                                                          scored=bool(method.tokens.needs)).head_tokens(tokens_seen)
    paper, executed, forward_tokens = extra_flops([*method.extra_work(tokens_seen), step_work], fm)
    return step_flops(fm, tokens_seen=tokens_seen, tokens_kept=tokens_kept, head_backward_tokens=head_bwd,
                      head_recompute_tokens=head_recompute, extra_forward_tokens=forward_tokens,
                      extra_flops_paper=paper, extra_flops_executed=executed)


class FlopsCounter:
    """Cumulative ``flops_paper``, ``flops_executed``, ``flops_dense`` over a run.

    count_per="global": every micro-batch of every rank (the FLOPs the cluster spent).
    count_per="micro":  one micro-batch of one rank per optimizer step, what the paper's absolute budgets appear
                        to use (docs/flops.md, "Counting per micro-batch or per global batch").
    """

    def __init__(self, count_per: str):
        self.count_per = count_per  # one of COUNT_PER, validated with the config
        self._totals = {k: 0.0 for k in COUNTER_KEYS}

    def add(self, step_flops: StepFlops, *, micro_steps: int, world_size: int) -> None:
        """Count one optimizer step; ``step_flops`` describes ONE micro-batch on one rank (the step's mean)."""
        factor = micro_steps * world_size if self.count_per == "global" else 1
        self._totals[M.FLOPS_PAPER] += factor * float(step_flops.paper)
        self._totals[M.FLOPS_EXECUTED] += factor * float(step_flops.executed)
        self._totals[M.FLOPS_DENSE] += factor * float(step_flops.dense)

    def add_step(self, fm: FlopsModel, method, res, *, world_size: int) -> None:
        """Count one optimizer step of ``method`` from its ``eslm.train.step.StepResult`` (this rank's totals
        over the step's micro-batches and the step's own work per micro-batch; the micro-batch mean is what
        ``add`` takes)."""
        n = len(res.selections)
        self.add(micro_batch_flops(fm, method, tokens_seen=res.tokens_seen // n, tokens_kept=res.tokens_kept // n,
                                   step_work=res.work), micro_steps=n, world_size=world_size)

    def totals(self) -> dict:
        """{"flops_paper", "flops_executed", "flops_dense"}: cumulative FLOPs (Python floats)."""
        return dict(self._totals)

    def state_dict(self) -> dict:
        return {"count_per": self.count_per, **self._totals}

    def load_state_dict(self, state: dict) -> None:
        if state.get("count_per", self.count_per) != self.count_per:
            raise ConfigError(f"flops.count_per of the checkpoint is {state['count_per']!r}; found "
                              f"{self.count_per!r} in the config; fix: resume with "
                              f"flops.count_per={state['count_per']}")
        self._totals = {k: float(state[k]) for k in COUNTER_KEYS}


def executed_savings(fm: FlopsModel, keep: float, *, recompute: bool = False) -> float:
    """Fraction of dense training FLOPs a fused selective loss saves at kept fraction ``keep`` (one token).

    Saved: the head backward of dropped tokens, (1 - keep) * 4CV; spent with ``recompute``: the head forward
    of kept tokens, keep * 2CV. Divided by 6N + 12LHQT.
    """
    s = step_flops(fm, tokens_seen=1, tokens_kept=keep, head_backward_tokens=keep,
                   head_recompute_tokens=keep if recompute else 0)
    return 1.0 - s.executed / s.dense


def micro_steps_for_budget(fm: FlopsModel, budget_flops: float, micro_batch_tokens: int) -> float:
    """Optimizer steps a dense run takes to reach ``budget_flops`` counting one micro-batch per step."""
    return budget_flops / (fm.train_per_token * micro_batch_tokens)


def savings_table() -> list[dict]:
    """Per-token FLOPs / dense for the paper's sizes (T = 1024, V = 50304) and alphas, keep = 1 - alpha (rows of
    plain floats); its columns: docs/flops.md, "Savings table"."""
    rows = []
    for name in ("gpt2-124m", "gpt2-350m", "gpt2-774m"):
        fm = FlopsModel.from_config(preset(name, vocab_size=50304), 1024)
        for alpha in (0.1, 0.2, 0.5):
            keep = 1.0 - alpha
            s = step_flops(fm, tokens_seen=1, tokens_kept=keep, head_backward_tokens=1)
            rows.append({"model": name, "n_params": fm.n_params, "alpha": alpha,
                         "paper": s.paper / s.dense, "masked": s.executed / s.dense,
                         "fused_cached": 1.0 - executed_savings(fm, keep),
                         "fused_recompute": 1.0 - executed_savings(fm, keep, recompute=True)})
    return rows


def format_savings_table(rows: list[dict]) -> str:
    """A Markdown table of ``savings_table()`` rows."""
    lines = ["| model | N | alpha | paper / dense | executed / dense: masked | fused, cached logits "
             "| fused, recompute |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n_params'] / 1e6:.1f}M | {r['alpha']:.1f} | {r['paper']:.4f} "
                     f"| {r['masked']:.4f} | {r['fused_cached']:.4f} | {r['fused_recompute']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m eslm.flops
    print(format_savings_table(savings_table()))
    fm = FlopsModel.from_config(preset("gpt2-124m"), 1024)
    steps = micro_steps_for_budget(fm, 3e17, 12 * 1024)
    print(f"\n124M: {fm.train_per_token:.4g} FLOPs/token; 3E17 FLOPs = {steps:,.0f} steps of 12x1024 tokens "
          f"counted per micro-batch, {steps / 40:,.0f} steps counted per global batch (x40)")
