"""Baselines of the paper's comparison, as standalone components (wired into methods by ``eslm.methods``).

Each baseline is one module: its settings (a ``Section``), its maths and its plug-in of the step.

* ``eslm.baselines.rho1``    Rho-1: ``Rho1Section``, the excess-loss score and ``Rho1Selector`` (a token selector);
                              the frozen reference model itself is ``eslm.objectives.frozen.ReferenceModel``,
                              shared with the KD teacher.
* ``eslm.baselines.greats``  GREATS: online row selection (ghost inner products + greedy), its cost,
                              ``GreatsSection`` and ``GreatsRows`` (a row selector, with its wiring:
                              ``GreatsRows.from_settings``).

The distillation objectives (Dense-KD, ESLM-KD, SALT) are ``eslm.objectives.kd_objective`` (their loss:
``eslm.objectives.distill``).
Nothing is imported here at package import time.
"""
