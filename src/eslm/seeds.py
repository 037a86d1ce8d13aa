"""Every random stream of a training run and the seed it draws from, in one place.

With ``run.seed = s`` and rank ``r``:

| stream | seed |
|---|---|
| torch / numpy / random at start (model init, dropout) | ``process(s, r)`` = s + r |
| the training batches (``TrainLoader``; batch i of rank r from (seed, r, i)) | s |
| the fixed validation windows (the same text for every run, so runs compare) | ``VAL_WINDOWS`` = 0 |
| GREATS' validation batches | ``greats_val(s)`` = s + 104729 |
| GREATS' extra candidate rows (``method.greats.pool=pool``) | ``greats_candidates(s)`` = s + 209459 |
| the random-drop control's generator | ``random_control(s, r)`` = 7919 s + r |
| the random-instance controls' generator (rows) | ``random_instances(s, r)`` = 7919 s + r + 15485863 |

GREATS' two loaders are ``TrainLoader``s like the training one; their offsets keep the three streams of a run
(and of runs whose seeds differ by less than 104729) apart.
Changing any of them changes every run's numbers (``benchmarks/refactor_losses.py`` says so).
"""

VAL_WINDOWS = 0


def process(seed: int, rank: int) -> int:
    return seed + rank


def greats_val(seed: int) -> int:
    return seed + 104729


def greats_candidates(seed: int) -> int:
    return seed + 209459


def random_control(seed: int, rank: int) -> int:
    return seed * 7919 + rank


def random_instances(seed: int, rank: int) -> int:
    return random_control(seed, rank) + 15485863
