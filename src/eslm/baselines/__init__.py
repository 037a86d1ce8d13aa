"""Baselines of the paper's comparison, as standalone components (wired into methods by ``eslm.methods``).

* ``eslm.baselines.rho1``    Rho-1's excess-loss score and its settings (the frozen reference model itself is
                              ``eslm.objectives.frozen.ReferenceModel``, shared with the KD teacher).
* ``eslm.baselines.greats``  GREATS' online row selection (ghost inner products + greedy) and its cost.
* ``eslm.baselines.plugins`` the two as plug-ins of the step: ``Rho1Selector`` (a token selector) and
                              ``GreatsRows`` (a row selector), with GREATS' settings.

The distillation objectives (Dense-KD, ESLM-KD, SALT) are ``eslm.objectives.kd_objective`` (their loss:
``eslm.objectives.distill``).
Nothing is imported here at package import time.
"""
