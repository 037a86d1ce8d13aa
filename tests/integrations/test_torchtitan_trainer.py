"""ESLM in torchtitan itself (0.3.0 from PyPI): ``loss_config`` set as a torchtitan ``Trainer.Config.loss``, built
by the config as the trainer builds it, and called by torchtitan's own forward-backward body
(``Trainer._forward_backward_body``: ``loss, _ = self.loss_fn(pred, labels, global_valid_tokens)`` then
``loss.backward()``) on two gloo ranks with a tiny model sharded by FSDP2 with torchtitan's gradient division
turned off, the divisor counted as torchtitan's ``train_step`` counts it (the valid labels of every micro-batch
of both ranks). Skipped where torchtitan is not installed (it is not part of eslm[all]: see docs/dropin.md;
.ci/run installs it in a venv of its own and runs this file there with ESLM_REQUIRE_TORCHTITAN=1, which makes a
failed import fail)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("ESLM_REQUIRE_TORCHTITAN"):  # CI's torchtitan venv: a failed import fails, not skips
    import torchtitan.trainer  # noqa: F401
else:
    pytest.importorskip("torchtitan.trainer", reason="torchtitan is not installed (see docs/dropin.md)")

V, C, T, ALPHA = 37, 8, 12, 0.25
HERE = Path(__file__).resolve().parent

SCRIPT = r'''
import contextlib, sys, types
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
from torchtitan.trainer import Trainer

sys.path.insert(0, sys.argv[2])
from test_torchtitan_trainer import ALPHA, _NoDeviceMemory, _Recorder, micro_batches, tiny_model
from eslm.integrations.torchtitan import chunked_loss_config, loss_config, metrics_config
from torchtitan.components import metrics as titan_metrics
from torchtitan.distributed import parallel_dims as titan_parallel_dims
from torchtitan.distributed.parallel_dims import ParallelDims

dist.init_process_group("gloo")
rank = dist.get_rank()
model = tiny_model()
mesh = init_device_mesh("cpu", (2,))
fully_shard(model.head, mesh=mesh)  # torchtitan shards its lm_head on its own (ChunkedLossWrapper relies on it)
fully_shard(model.body, mesh=mesh)
fully_shard(model, mesh=mesh)
disable_fsdp_gradient_division(model)  # torchtitan's own setting: gradients summed over ranks
for m in model.modules():  # gloo has no PREMUL_SUM (what a divide factor of 1 asks for): the same sum, as SUM
    if hasattr(m, "set_force_sum_reduction_for_comms"):
        m.set_force_sum_reduction_for_comms(True)

config = Trainer.Config(loss=loss_config(alpha=ALPHA, score="loss"), metrics=metrics_config(log_freq=1))
loss_fn = config.loss.build(compile_config=config.compile)  # as Trainer.__init__ builds it
titan_metrics.build_device_memory_monitor, titan_parallel_dims.device_type = _NoDeviceMemory, "cpu"
processor = config.metrics.build(parallel_dims=ParallelDims(  # its loss mesh: both ranks
    dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2, spmd_backend="partial_dtensor"))
processor.logger, processor.num_flops_per_token = _Recorder(), 1
chunked = chunked_loss_config(alpha=ALPHA, score="loss", num_chunks=3).build(compile_config=config.compile)
chunked.set_lm_head(model.head)  # as Trainer.__init__ does for a ChunkedLossWrapper
trainer = types.SimpleNamespace(model_parts=[model], loss_fn=loss_fn, train_context=contextlib.nullcontext)
out = {}
for case in ("packed", "padded", "chunked"):
    micro = micro_batches(rank, padded=case != "packed")
    trainer.loss_fn, model._skip_lm_head = (chunked, True) if case == "chunked" else (loss_fn, False)
    valid = sum((labels != IGNORE_INDEX).sum() for _, labels in micro)  # Trainer.train_step's count
    dist.all_reduce(valid)
    losses = [Trainer._forward_backward_body(trainer, x, y, valid, {}).detach() for x, y in micro]
    out[case] = {"loss": float(sum(losses)), "valid": int(valid),
                 "grads": [p.grad.full_tensor().clone() for p in model.parameters()]}
    processor.data_loading_times = [0.0]  # what the batch generator records, cleared by each log
    processor.log(1, 0.0, 0.0, 0.0)  # what train_step's log reaches: the eslm/* metrics of both ranks
    out[case]["metrics"] = {k: v for k, v in processor.logger.logged[1].items() if k.startswith("eslm/")}
    model.zero_grad()
model._skip_lm_head = False
out["metrics"] = sorted(loss_fn(model(micro[0][0]), micro[0][1], valid)[1])
torch.save(out, f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
'''


class Tiny(torch.nn.Module):
    """An embedding, one hidden block and an LM head: logits (B, T, V), as torchtitan's models return them (the
    final hidden states when the trainer sets ``_skip_lm_head`` for its ChunkedLossWrapper, as its Decoder)."""

    _skip_lm_head = False

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, C)
        self.body = torch.nn.Sequential(torch.nn.Linear(C, C), torch.nn.Tanh())
        self.head = torch.nn.Linear(C, V, bias=False)

    @property
    def lm_head(self):
        return self.head

    def forward(self, x):
        h = self.body(self.emb(x))
        return h if self._skip_lm_head else self.head(h)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Tiny()


def micro_batches(rank: int, *, padded: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of (inputs, labels) for ``rank``; ``padded``: each its own number of -100 labels."""
    out = []
    for i in range(2):
        g = torch.Generator().manual_seed(10 * rank + i)
        x = torch.randint(0, V, (2, T), generator=g)
        y = torch.randint(0, V, (2, T), generator=g)
        if padded:
            y[0, T - (3 + 4 * i + rank):] = -100
        out.append((x, y))
    return out


def _by_hand(micro: list, *, weighted: bool):
    """The loss and gradient by hand on one process with the full model: the mean CE over the kept tokens of
    all micro-batches (``weighted``: each micro-batch's kept mean x its valid tokens / all valid tokens)."""
    model = tiny_model()
    parts, n_all = [], sum(int((y != -100).sum()) for _, y in micro)
    for x, y in micro:
        ce = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1).clamp(min=0), reduction="none")
        score = ce.detach().masked_fill(y.reshape(-1) == -100, float("-inf"))
        n = int((y != -100).sum())
        kept = ce[torch.topk(score, n - math.floor(ALPHA * n)).indices]
        parts.append((kept, n))
    k_all = sum(len(k) for k, _ in parts)
    loss = sum(k.sum() * n / len(k) / n_all for k, n in parts) if weighted else sum(k.sum() for k, _ in parts) / k_all
    loss.backward()
    return float(loss), [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_torchtitan_trainer_step_with_the_eslm_loss_hook(tmp_path):
    from conftest import torchrun

    script = tmp_path / "titan.py"
    script.write_text(SCRIPT)
    torchrun([str(script), str(tmp_path), str(HERE)])
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert r[0]["metrics"] == ["eslm/cvar", "eslm/kept_frac", "eslm/var"]
    for case, weighted in (("packed", False), ("padded", True), ("chunked", True)):
        for a, b in zip(r[0][case]["grads"], r[1][case]["grads"]):
            assert torch.equal(a, b)
        micro = micro_batches(0, padded=weighted) + micro_batches(1, padded=weighted)
        assert r[0][case]["valid"] == sum(int((y != -100).sum()) for _, y in micro)
        loss, grads = _by_hand(micro, weighted=weighted)
        assert r[0][case]["loss"] + r[1][case]["loss"] == pytest.approx(loss, rel=1e-5), case
        for got, want in zip(r[0][case]["grads"], grads):
            assert torch.allclose(got, want, atol=1e-6), case
        selection = _selection_by_hand(micro)  # metrics_config's log: summed over both ranks' micro-batches
        assert r[0][case]["metrics"] == r[1][case]["metrics"]
        assert r[0][case]["metrics"] == pytest.approx(selection, rel=1e-5), case


def test_loss_config_is_torchtitans_loss_hook():
    """The config is a torchtitan BaseLoss.Config that builds the ESLM loss; a bad alpha is refused at build."""
    from torchtitan.components.loss import BaseLoss
    from torchtitan.trainer import Trainer

    from eslm.errors import ESLMError
    from eslm.integrations.torchtitan import loss_config

    config = Trainer.Config(loss=loss_config(alpha=0.3))
    assert isinstance(config.loss, BaseLoss.Config)
    loss_fn = config.loss.build(compile_config=config.compile)
    assert isinstance(loss_fn, BaseLoss)
    logits, labels = torch.randn(1, 10, V), torch.randint(0, V, (1, 10))
    _, m = loss_fn(logits, labels, torch.tensor(10))
    assert float(m["eslm/kept_frac"]) == pytest.approx(0.7)
    with pytest.raises(ESLMError):
        loss_config(alpha=1.5).build(compile_config=config.compile)


def test_torchtitans_validator_reports_the_plain_cross_entropy(monkeypatch):
    """torchtitan's own ``Validator.validate`` (its loop: the loss_fn called without a divisor on each batch, the
    sums added, divided by the valid tokens, logged through ``metrics_processor.log_validation``) with the ESLM
    loss the trainer reuses: the logged loss is the plain mean CE over the valid tokens by hand, equal to what
    torchtitan's CrossEntropyLoss gives (it was the kept mean summed: ~0.18 where CE gave ~4.1). The pieces
    around the loop (dataloader, post-processing, metrics) are stand-ins with torchtitan's interfaces."""
    import contextlib
    import types

    from torchtitan.components import validate as titan_validate
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.validate import Validator

    from eslm.integrations.torchtitan import loss_config

    monkeypatch.setattr(titan_validate.utils, "device_type", "cpu")  # it assumes CUDA where none is found
    model = tiny_model()
    batches = [({"input": x}, y) for x, y in micro_batches(0, padded=True)]

    def validate(loss_fn) -> float:
        logged = {}
        v = types.SimpleNamespace(
            config=types.SimpleNamespace(steps=-1), parallel_dims=types.SimpleNamespace(
                dp_enabled=False, pp_enabled=False, dp_cp_enabled=False),
            dl_config=types.SimpleNamespace(build=lambda **kw: list(batches)), dp_world_size=1, dp_rank=0,
            tokenizer=None, seq_len=T, local_batch_size=2, loss_fn=loss_fn,
            validation_context=contextlib.nullcontext,
            metrics_processor=types.SimpleNamespace(ntokens_since_last_log=0,
                                                    log_validation=lambda loss, step: logged.update(loss=loss)),
            post_dataloading_process=lambda input_dict, labels, model_parts: (input_dict["input"], labels, {}))
        Validator.validate(v, [model], step=1)
        return logged["loss"]

    with torch.no_grad():
        x = torch.cat([b[0]["input"] for b in batches])
        y = torch.cat([b[1] for b in batches])
        hand = float(F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100))
    eslm = validate(loss_config(alpha=ALPHA).build())
    titan = validate(CrossEntropyLoss.Config().build())
    assert eslm == pytest.approx(hand, rel=1e-6) and titan == pytest.approx(hand, rel=1e-6)


class _Recorder:
    """torchtitan's BaseLogger interface: keeps what the metrics processor logs."""

    def __init__(self):
        self.logged: dict[int, dict] = {}

    def log(self, metrics, step):
        self.logged[step] = dict(metrics)

    def close(self):
        pass


class _NoDeviceMemory:
    """torchtitan's DeviceMemoryMonitor interface on CPU (its own one asks CUDA for the device name)."""

    device_name = "cpu"

    def get_peak_stats(self):
        import types

        return types.SimpleNamespace(max_active_gib=0.0, max_active_pct=0.0, max_reserved_gib=0.0,
                                     max_reserved_pct=0.0, num_alloc_retries=0, num_ooms=0)

    def reset_peak_stats(self):
        pass


def _titan_train_step(loss_config, micro: list, monkeypatch, *, chunked: bool):
    """torchtitan's own ``Trainer.train_step`` (two gradient-accumulation micro-batches, its valid-token count,
    ``forward_backward_step``, ``post_dataloading_process``, ``_forward_backward_body``, gradient clipping and
    its metrics log) on one CPU process, with the loss built from ``loss_config`` as ``Trainer.__init__`` builds
    it and the metrics processor from ``metrics_config``. Stand-ins only for the optimizer (keeping the gradients
    it steps with), the LR schedulers, the checkpointer, the device memory monitor and the metrics' logger
    backend. Returns (logged metrics, gradients)."""
    import contextlib
    import types

    from torchtitan.components import metrics as titan_metrics
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.trainer import Trainer

    from eslm.integrations.torchtitan import metrics_config

    monkeypatch.setattr(titan_metrics, "build_device_memory_monitor", _NoDeviceMemory)
    config = Trainer.Config(loss=loss_config, metrics=metrics_config(log_freq=1))
    config.training.max_norm = 1e9  # clipping never scales the gradients compared
    config.parallelism.spmd_backend = "partial_dtensor"  # one process, no mesh: plain tensors
    trainer = object.__new__(Trainer)
    model = tiny_model()
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                                 spmd_backend="partial_dtensor")
    grads: list = []

    def step():
        grads.extend(p.grad.clone() for p in model.parameters())

    trainer.config, trainer.parallel_dims, trainer.model_parts, trainer.device = config, parallel_dims, [model], "cpu"
    trainer.model_config = None
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(trainer.loss_fn, ChunkedLossWrapper):  # as Trainer.__init__ sets it up
        trainer.loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    assert chunked == model._skip_lm_head
    trainer.metrics_processor = config.metrics.build(parallel_dims=parallel_dims)
    trainer.metrics_processor.logger = recorder = _Recorder()
    trainer.metrics_processor.num_flops_per_token = 1
    trainer.metrics_processor.data_loading_times = [0.0]
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = len(micro), 1
    trainer.step, trainer.ntokens_seen = 1, 0
    trainer.train_context = contextlib.nullcontext
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    trainer.optimizers = types.SimpleNamespace(zero_grad=lambda **kw: model.zero_grad(), step=step)
    trainer.lr_schedulers = types.SimpleNamespace(get_metrics=lambda: {}, step=lambda: None)
    trainer.checkpointer = types.SimpleNamespace(maybe_wait_for_staging=lambda: None)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchtitan's mesh: one rank
    try:
        trainer.train_step(iter([({"input": x}, y) for x, y in micro]))
    finally:
        dist.destroy_process_group()
    return recorder.logged[1], grads


def _selection_by_hand(micro: list) -> dict[str, float]:
    """kept_frac, the mean of the micro-batches' VaR thresholds, and the mean kept score (score="loss"), by hand."""
    model = tiny_model()
    kept_all, valid_all, thresholds = [], 0, []
    with torch.no_grad():
        for x, y in micro:
            ce = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1).clamp(min=0), reduction="none")
            n = int((y != -100).sum())
            kept = torch.topk(ce.masked_fill(y.reshape(-1) == -100, float("-inf")), n - math.floor(ALPHA * n)).values
            kept_all.append(kept)
            valid_all += n
            thresholds.append(float(kept.min()))
    kept = torch.cat(kept_all)
    return {"eslm/kept_frac": len(kept) / valid_all, "eslm/var": sum(thresholds) / len(thresholds),
            "eslm/cvar": float(kept.mean())}


@pytest.mark.parametrize("chunked", [False, True], ids=["loss_config", "chunked_loss_config"])
def test_torchtitans_train_step_logs_the_kept_mean_and_the_selection(chunked, monkeypatch):
    """torchtitan's ``Trainer.train_step`` with two padded micro-batches: the logged loss and the gradient equal
    the hand computation (each micro-batch's kept mean weighted by its valid tokens), and torchtitan's metrics log
    carries eslm/kept_frac, eslm/var and eslm/cvar equal to the selection by hand. Chunked (torchtitan's
    ChunkedLossWrapper, 3 chunks, through ``chunked_loss_config``): the same tokens kept over each whole
    micro-batch, so the same loss, gradient and metrics."""
    from eslm.integrations.torchtitan import chunked_loss_config, loss_config

    micro = micro_batches(0, padded=True)
    config = (chunked_loss_config(alpha=ALPHA, score="loss", num_chunks=3) if chunked
              else loss_config(alpha=ALPHA, score="loss"))
    logged, grads = _titan_train_step(config, micro, monkeypatch, chunked=chunked)
    loss, want = _by_hand(micro, weighted=True)
    assert logged["loss_metrics/global_avg_loss"] == pytest.approx(loss, rel=1e-5)
    for got, w in zip(grads, want):
        assert torch.allclose(got, w, atol=1e-6)
    for key, value in _selection_by_hand(micro).items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key


def test_loss_config_inside_torchtitans_own_chunked_wrapper_is_refused():
    """Wrapped in torchtitan's ChunkedLossWrapper, loss_config's loss would select per chunk: one line naming
    chunked_loss_config, at the first chunk (not torchtitan's error about reducing 'eslm/var' at the second)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    from eslm.errors import ConfigError
    from eslm.integrations.torchtitan import loss_config

    model = tiny_model()
    wrapper = ChunkedLossWrapper.Config(num_chunks=3, loss_fn=loss_config(alpha=ALPHA)).build()
    wrapper.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    x, y = micro_batches(0, padded=False)[0]
    with pytest.raises(ConfigError, match="chunked_loss_config") as e:
        wrapper(model(x), y, torch.tensor(int((y != -100).sum())))
    assert "\n" not in str(e.value)


def test_chunked_loss_config_refuses_dtensor_hidden_states():
    """Tensor / sequence parallel hidden states (a DTensor) are refused in one line, not chunked wrongly."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from eslm.errors import ConfigError
    from eslm.integrations.torchtitan import chunked_loss_config

    model = tiny_model()
    wrapper = chunked_loss_config(alpha=ALPHA, num_chunks=3).build()
    wrapper.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    x, y = micro_batches(0, padded=False)[0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        h = distribute_tensor(model(x).detach(), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(ConfigError, match="DTensor") as e:
            wrapper(h, y, torch.tensor(int((y != -100).sum())))
    finally:
        dist.destroy_process_group()
    assert "\n" not in str(e.value)


def test_the_docs_torchtitan_snippet_builds():
    """docs/dropin.md's torchtitan snippet, run as written: the configs are torchtitan's, and build."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.components.metrics import MetricsProcessor

    text = (HERE.parents[1] / "docs" / "dropin.md").read_text()
    section = text[text.index("\n## torchtitan\n"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    scope: dict = {}
    exec(code, scope)
    config = scope["config"]
    assert isinstance(config.metrics, MetricsProcessor.Config) and type(config.metrics) is not MetricsProcessor.Config
    assert isinstance(config.loss.build(), ChunkedLossWrapper) and config.loss.num_chunks == 8
