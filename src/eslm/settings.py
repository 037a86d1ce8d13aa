"""Config sections of the methods: ``setting`` (a field with its help text) and ``Section`` (a section's key, help
and checks).

The lowest layer, so that each method's config section can be declared next to its components
(``eslm.selection.ada.AdaSection``, ``eslm.baselines.rho1.Rho1Section``, ``eslm.objectives.kd_objective.KDSection``,
``eslm.baselines.greats.GreatsSection``). A method names its sections in its registry line
(``MethodSpec.settings`` in ``eslm.methods``); ``eslm.config`` assembles ``method.*`` from the registry (one field
per section) and runs each section's ``problems``, so a new section edits no central file.
"""

from __future__ import annotations

import copy
from dataclasses import field
from functools import partial


def setting(default, help: str, *, key: str | None = None, **kw):
    """A dataclass field with ``help`` metadata; ``key`` names it in YAML and overrides when the attribute name
    cannot (``lambda_`` is ``method.kd.lambda``)."""
    meta = {"help": help, **kw}
    if key is not None:
        meta["key"] = key
    if isinstance(default, (dict, list)):
        return field(default_factory=partial(copy.copy, default), metadata=meta)
    return field(default=default, metadata=meta)


def key_of(f) -> str:
    """The config key of a dataclass field (its ``key`` metadata, else its name)."""
    return f.metadata.get("key", f.name)


class Section:
    """Base of a method's config section (subclasses are frozen dataclasses of ``setting`` fields).

    ``key`` (class attribute, not a setting): the section's place, ``method.<key>.*``; ``help`` its one-line
    description in ``eslm train --help``.

    ``problems`` checks the section's own values: every problem is one string starting with the key relative to
    the section (``"lambda: expected a value in [0, 1], got 1.5"``); ``eslm.config.validate`` prefixes the
    section's path (``method.kd.``) and reports them with every other problem at once. Checks that need
    other sections (a method's required reference model) belong to the method's ``MethodSpec.validate``."""

    key: str = ""
    help: str = ""

    def problems(self) -> list[str]:
        return []
