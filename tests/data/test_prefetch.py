"""StepBatches: a step's micro-batches drawn ahead (on CUDA, into pinned memory), the same batches in the same order
as the plain loader, and a checkpointed position that is that of the batches handed out. Pinned memory needs an
accelerator; the drawing ahead runs here without pinned memory."""

import functools

import torch

from conftest import tiny_overrides
from eslm.config import build_config
from eslm.data.loader import StepBatches, TrainLoader, open_dataset
from eslm.train import checkpoint as ckpt
from eslm.train import trainer as trainer_mod


def _loader(data):
    ds = open_dataset(data)
    return TrainLoader(ds, seq_len=16, micro_batch_size_seqs=2, weights={d: 1.0 / len(ds.domains) for d in ds.domains}, seed=3)


def _same(a, b) -> bool:
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in ("x", "y", "domain"))


def test_drawing_ahead_hands_out_the_plain_loaders_batches_and_saves_their_position(tiny_data):
    plain, ahead = _loader(tiny_data), StepBatches(_loader(tiny_data), torch.device("cpu"), 3, ahead=True)
    for _ in range(2):
        step = ahead.next_step()
        ahead.prefetch()
        assert _same(step, [plain.next_batch() for _ in range(3)])
    assert ahead.loader.batch_index == 9 and ahead.state_dict() == plain.state_dict()  # 3 drawn ahead, not handed out
    resumed = StepBatches(_loader(tiny_data), torch.device("cpu"), 3, ahead=True)
    resumed.prefetch()  # whatever it drew ahead is dropped by the load
    resumed.load_state_dict(ahead.state_dict())
    assert _same(resumed.next_step(), ahead.next_step())


def test_off_cuda_nothing_is_drawn_ahead_and_on_cuda_it_is_pinned(tiny_data):
    b = StepBatches(_loader(tiny_data), torch.device("cpu"), 2)
    b.next_step()
    b.prefetch()
    assert b.loader.batch_index == 2 and (b.ahead, b.pin) == (False, False)
    cuda = StepBatches(_loader(tiny_data), torch.device("cuda"), 2)  # built without touching a GPU
    assert (cuda.ahead, cuda.pin) == (True, True)


def test_the_trainer_checkpoints_the_position_of_the_batches_it_trained_on(tiny_data, tmp_path, monkeypatch):
    """Trained with batches drawn ahead (as on CUDA), the checkpoint after 3 steps of 2 micro-batches resumes at
    batch 6, not at the 8 the loader has drawn."""
    monkeypatch.setattr(trainer_mod, "StepBatches", functools.partial(StepBatches, ahead=True))
    cfg = build_config(overrides=tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 3, "eval.interval": 0,
                                                                        "checkpoint.interval": 0}))
    res = trainer_mod.train(cfg)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(res.run_dir))
    assert state["step"] == 3 and state["loader"]["batch_index"] == 6
