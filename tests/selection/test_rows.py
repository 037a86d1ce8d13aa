"""``eslm.selection.rows.AllRows``: the default row selector keeps every row and declares no work."""

import torch

from eslm.contracts import ExtraWork, RowSelector
from eslm.data.batch import Batch
from eslm.selection.rows import AllRows


def _batch(rows=3, T=5):
    x = torch.arange(rows * T).view(rows, T)
    return Batch(x=x, y=x + 1, domain=torch.arange(rows) % 2)


def test_all_rows_keeps_the_batch_itself():
    rows, batch = AllRows(), _batch()
    kept, info = rows.select(model=None, batch=batch, step=1, lr=1e-3)
    assert kept is batch and info == {}


def test_counts_are_the_loader_rows():
    rows = AllRows()
    for b in (1, 4, 12):
        assert rows.candidate_rows(b) == b and rows.num_rows(b) == b


def test_no_extra_work_and_empty_state():
    rows = AllRows()
    assert isinstance(rows, RowSelector)
    assert rows.extra_work(1024) == ExtraWork() and rows.extra_work(0).priced == ()
    assert rows.state_dict() == {}
    rows.load_state_dict({})
