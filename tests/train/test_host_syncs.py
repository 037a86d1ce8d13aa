"""The training loop's host syncs: one read per optimizer step (the loss, gradient norm and what a logged step
records, read together), and a non-finite step skipped on the device by the fused AdamW built for CUDA.

On the CPU the reads are counted by ``HostReads`` (every aten op that would wait for a GPU: item(), float() or
bool() of a tensor, nonzero, boolean masks ...) plus ``Tensor.tolist``/``numpy``/``cpu`` and
``torch.cuda.synchronize``, which a dispatch mode does not see on the CPU. The optimizer is the one built for CUDA
(the fused AdamW, which torch also runs on the CPU): the CPU's default AdamW reads its own step count on the host,
a CPU tensor there and on a GPU alike, which would be no sync on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import HostReads, tiny_overrides
from eslm.config import build_config
from eslm.train import optim
from eslm.train import trainer as trainer_mod
from eslm.train.trainer import Trainer, TrainingDiverged


@contextlib.contextmanager
def counted_reads():
    """Yields the list of host reads made inside the block (names)."""
    reads: list[str] = []
    patched = {}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            reads.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.Tensor, "cpu"),
                        (torch.cuda, "synchronize")):
        patched[(owner, name)] = getattr(owner, name)
        setattr(owner, name, counting(f"{getattr(owner, '__name__', owner)}.{name}", patched[(owner, name)]))
    try:
        with HostReads(record=reads):
            yield reads
    finally:
        for (owner, name), fn in patched.items():
            setattr(owner, name, fn)


def cuda_optimizer(monkeypatch):
    """The trainer builds its AdamW as it would for a CUDA device (fused)."""
    build = optim.build_optimizer
    monkeypatch.setattr(trainer_mod, "build_optimizer", lambda model, **kw: build(model, **{**kw,
                                                                                         "device_type": "cuda"}))


STEPS = [("clm", {}), ("eslm-entropy", {}), ("eslm-loss", {}), ("random", {}),
         ("eslm-entropy", {"train.normalize": "global"})]


@pytest.mark.parametrize("name,extra", STEPS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k.split('.')[-1]}={v}" for k, v in x.items()) or "default")
def test_one_host_read_per_optimizer_step(name, extra, tiny_data, tmp_path, monkeypatch):
    """Five optimizer steps of two micro-batches each, logged (log.interval 2) and not: one read per step,
    after the update is queued (the read before it, as the loop did, would keep the GPU waiting for the host)."""
    cuda_optimizer(monkeypatch)
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{
        "method.name": name, "train.max_steps": 6, "log.interval": 2, "train.grad_accum_steps": 2, **extra}))
    trainer = Trainer(cfg)
    assert optim.skips_on_device(trainer.optimizer)
    trainer._train_one_step()  # lazy one-time initialisation (optimizer state)
    per_step, step = [], trainer.optimizer.step
    for _ in range(5):
        with counted_reads() as reads:
            trainer.optimizer.step = lambda: (reads.append("optimizer.step"), step())[1]  # type: ignore
            update = trainer._train_one_step()
        per_step.append(reads)
        assert len(update.selection) == (0 if name == "clm" or trainer.step % 2 else 3 + 2 * 2)
    assert per_step == [["optimizer.step", "Tensor.tolist"]] * 5, per_step


def test_the_counter_sees_a_second_read(tiny_data, tmp_path, monkeypatch):
    """A read added to the hot loop (here the all-token CE read on its own, as the record used to) is caught."""
    cuda_optimizer(monkeypatch)
    trainer = Trainer(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": "eslm-loss"})))
    trainer._train_one_step()
    original = trainer_mod.forward_backward

    def with_extra_read(*args, **kwargs):
        res = original(*args, **kwargs)
        float(res.loss_all)
        return res

    monkeypatch.setattr(trainer_mod, "forward_backward", with_extra_read)
    with counted_reads() as reads:
        trainer._train_one_step()
    assert reads == ["aten._local_scalar_dense", "Tensor.tolist"]


def _state(trainer) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in trainer.raw_model.parameters()]
    moments = [v.clone() for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return params + moments


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_non_finite_step_changes_nothing(device_type, tiny_data, tmp_path, monkeypatch):
    """A NaN weight makes the loss and every gradient NaN: the step raises TrainingDiverged and leaves weights,
    moments and step counts exactly as they were, whether the fused AdamW skipped it on the device (as built for
    CUDA) or the host did not call it (the CPU's default AdamW)."""
    if device_type == "cuda":
        cuda_optimizer(monkeypatch)
    trainer = Trainer(build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"method.name": "eslm-loss"})))
    assert optim.skips_on_device(trainer.optimizer) == (device_type == "cuda")
    trainer._train_one_step()  # optimizer state exists
    with torch.no_grad():
        trainer.raw_model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    before = _state(trainer)
    with pytest.raises(TrainingDiverged, match="non-finite loss .* at step 2"):
        trainer._train_one_step()
    after = _state(trainer)
    assert len(after) == len(before) and trainer.step == 1
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_finite_step_is_the_same_update_with_the_flag():
    """The fused AdamW given a found_inf flag of 0 takes exactly the update it takes without one."""
    out = []
    for guarded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        opt = optim.build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), device_type="cuda")
        for i in range(3):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).square().sum()
            loss.backward()
            if guarded:
                values = optim.step_if_finite(opt, torch.stack([loss.detach(), torch.tensor(1.0)]))
                assert values[0] == loss.item()
            else:
                opt.step()
            opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()] +
                   [v.clone() for st in opt.state.values() for v in st.values()])
    for a, b in zip(*out):
        assert torch.equal(a, b)
