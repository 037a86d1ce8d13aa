"""Baselines of the paper's comparison, one module each (its settings, its maths and its plug-in of the step),
wired into methods by ``eslm.methods``: ``rho1`` (Rho-1's excess-loss selector; its frozen reference is
``eslm.objectives.frozen.ReferenceModel``, shared with the KD teacher) and ``greats`` (GREATS' row selector). The
distillation objectives (Dense-KD, ESLM-KD, SALT) are ``eslm.objectives.kd_objective``. Nothing is imported here.
"""
