"""Baselines of the paper's comparison, as standalone components (wired into methods by ``eslm.methods``).

* ``eslm.baselines.rho1``   Rho-1's frozen reference model and the excess-loss score.
* ``eslm.baselines.greats`` GREATS' online row selection (ghost inner products + greedy).

The distillation objective (Dense-KD, ESLM-KD, SALT) lives in ``eslm.objectives.distill``.
Nothing is imported here at package import time.
"""
