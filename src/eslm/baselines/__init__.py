"""Baselines of the paper's comparison, one module each (its settings, its maths and its plug-in of the step),
wired into methods by ``eslm.methods``: ``rho1`` and ``greats``. The distillation objectives (Dense-KD, ESLM-KD,
SALT) are ``eslm.objectives.kd_objective``. Nothing is imported here.
"""
