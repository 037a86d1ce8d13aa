"""SALT's switch (``eslm.objectives.kd_objective.Salt``): dense KD for ``kd_steps`` optimizer steps, then plain
cross-entropy, with the step counter checkpointed."""

import pytest
import torch

from eslm.data.batch import Batch
from eslm.model.gpt import GPT, preset
from eslm.objectives.base import CrossEntropy
from eslm.objectives.frozen import ReferenceModel
from eslm.objectives.kd_objective import Distill, Salt

V, T = 64, 8


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    student, teacher = GPT(preset("tiny", vocab_size=V)), GPT(preset("tiny", vocab_size=V))
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    batch = Batch(x=x, y=x.roll(-1, 1), domain=torch.zeros(2, dtype=torch.long))
    kd = Distill(ReferenceModel(teacher, impl="naive"), lam=0.5, rho=1.0, seq_len=T, impl="naive")
    return student, batch, kd, CrossEntropy(impl="naive")


def _loss(obj, student, batch):
    hidden = student(batch.x).flatten(0, 1)
    return obj.loss_sum(hidden, student.head_weight, batch, None, None)[0].detach()


def test_kd_for_kd_steps_then_cross_entropy(parts):
    student, batch, kd, ce = parts
    salt = Salt(kd, ce, kd_steps=2)
    want_kd, want_ce = _loss(kd, student, batch), _loss(ce, student, batch)
    assert not torch.equal(want_kd, want_ce)
    for done in (0, 1):  # optimizer steps done so far: the next step is still KD
        salt.on_step_end(done)
        assert salt.active is kd and torch.equal(_loss(salt, student, batch), want_kd)
        assert salt.extra_work(16).passes[0].tokens == 16  # the teacher forward is paid
    salt.on_step_end(2)
    assert salt.active is ce and torch.equal(_loss(salt, student, batch), want_ce)
    assert salt.extra_work(16).passes == ()  # no teacher after the switch
    assert salt.head_work(16, 16, scored=False) == ce.head_work(16, 16, scored=False)


def test_zero_kd_steps_is_plain_cross_entropy(parts):
    _, _, kd, ce = parts
    assert Salt(kd, ce, kd_steps=0).active is ce


def test_step_counter_resumes(parts):
    _, _, kd, ce = parts
    salt = Salt(kd, ce, kd_steps=3)
    salt.on_step_end(3)
    resumed = Salt(kd, ce, kd_steps=3)
    resumed.load_state_dict(salt.state_dict())
    assert resumed.state_dict() == {"step": 3} and resumed.active is ce
