"""train/records.py: a record holds metrics only (every key a name declared in eslm.metrics), in the file's order."""

import dataclasses

import torch

from eslm import metrics as M
from eslm.flops import FlopsCounter
from eslm.selection.selectors import Selection
from eslm.selection.stats import SelectionStats
from eslm.train.records import Update, eval_record, readout, selection_metrics, train_record
from eslm.train.step import StepResult

DECLARED = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str)}
PREFIXES = (M.KEPT_FRAC_DOMAIN_PREFIX, M.VAL_LOSS_DOMAIN_PREFIX)


def _declared(key: str) -> bool:
    return key in DECLARED or key.startswith(PREFIXES)


class _Tokens:
    score, alpha = "entropy", 0.25


def _selection(kept, total):
    # every field of SelectionStats, so that a statistic added there needs no edit here
    zero = {f.name: torch.tensor(0.0) for f in dataclasses.fields(SelectionStats)}
    stats = SelectionStats(**{**zero, "num_tokens": torch.tensor(8), "num_kept": torch.tensor(2),
                              "kept_frac": torch.tensor(0.25), "threshold": torch.tensor(1.0), "cvar": torch.tensor(2.0),
                              "score_dropped_mean": torch.tensor(0.5), "kept_per_domain": torch.tensor(kept),
                              "tokens_per_domain": torch.tensor(total)})
    return Selection(torch.arange(2), 2, 8, stats)


def _update():
    res = StepResult(loss=torch.tensor(2.0), loss_all=torch.tensor(3.0), tokens_seen=16, tokens_kept=4,
                     selections=[_selection([1.0, 1.0], [4.0, 4.0]), _selection([2.0, 0.0], [8.0, 0.0])])
    values = readout(res, torch.tensor(0.5), with_selection=True).tolist()
    return Update(res, values[0], 1e-3, values[1], tokens_seen=32, loss_all=values[2], selection=values[3:])


def test_selection_metrics_average_micro_batches_and_split_by_domain():
    u = _update()
    out = selection_metrics(u.selection, _Tokens(), ["code", "docs"])
    assert out[M.ALPHA] == 0.25 and out[M.THRESHOLD] == 1.0 and out[M.CVAR] == 2.0
    assert out[M.kept_frac_key("code")] == 3.0 / 12.0 and out[M.kept_frac_key("docs")] == 1.0 / 4.0
    assert (u.loss, u.grad_norm, u.loss_all) == (2.0, 0.5, 3.0)


class _RandomControl:
    score, alpha = None, 0.25


def test_the_random_control_logs_no_score_statistics():
    # it ranks no scores: threshold, CVaR and dropped-score mean are absent from its records (not 0.0), while
    # its kept fraction per domain is logged like any selector's
    out = selection_metrics(_update().selection, _RandomControl(), ["code", "docs"])
    assert not {M.ALPHA, M.THRESHOLD, M.CVAR, M.SCORE_DROPPED_MEAN} & set(out)
    assert out[M.kept_frac_key("code")] == 3.0 / 12.0


def test_the_readout_holds_each_number_as_its_own_tensor_gave_it():
    """One read of one vector instead of a float() per number: the same fp32 values, bit for bit (the refactor
    guard's records), and only the loss, gradient norm and all-token CE on a step that is not logged."""
    res = _update().res
    res.selections[0].stats.threshold = torch.tensor(1.1)
    res.selections[1].stats.threshold = torch.tensor(0.7)
    values = readout(res, torch.tensor(0.3), with_selection=True).tolist()
    assert values[3] == float(torch.stack([torch.tensor(1.1), torch.tensor(0.7)]).mean())
    assert values[1] == float(torch.tensor(0.3)) and values[3 + 0] != 0.9  # fp32, not the float64 mean
    assert readout(res, torch.tensor(0.3), with_selection=False).tolist() == values[:3]
    assert selection_metrics([], _Tokens(), ["code", "docs"]) == {M.ALPHA: 0.25}


def test_a_train_record_holds_only_declared_metrics():
    u = _update()
    flops = FlopsCounter("global").totals()
    rec = train_record(u, 7, tokens_seen_total=1024, step_cpu_s=0.1, step_time_s=0.2, tokens_per_s=5.0,
                       elapsed_s=9.0, cpu_s=8.0, selection=selection_metrics(u.selection, _Tokens(), ["code", "docs"]),
                       flops_totals=flops, load_avg_1m=1.5, mfu=None)
    assert [k for k in rec if not _declared(k)] == []
    assert all(isinstance(v, (int, float, str)) for v in rec.values())  # JSON-ready, no tensors or payloads
    assert rec[M.KEPT_FRAC] == 4 / 16 and rec[M.TRAIN_LOSS_ALL] == 3.0 and rec[M.STEP] == 7
    assert M.MFU not in rec and rec[M.LOAD_AVG_1M] == 1.5
    assert list(rec)[:6] == [M.KIND, M.STEP, M.TRAIN_LOSS, M.LR, M.GRAD_NORM, M.KEPT_FRAC]


def test_an_eval_record_holds_only_declared_metrics():
    rec = eval_record(3, tokens_seen_total=10, elapsed_s=1.0, cpu_s=1.0, flops_totals=FlopsCounter("global").totals(),
                      val={M.VAL_LOSS: 2.0, M.val_loss_key("code"): 2.5})
    assert [k for k in rec if not _declared(k)] == [] and rec[M.KIND] == M.KIND_EVAL
