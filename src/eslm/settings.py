"""Config sections of the methods: ``setting`` (a field with its help text) and ``Section`` (a section's key, help
and checks). The lowest layer, so that each method's section is declared next to its components and named in its
registry line (``MethodSpec.settings``): a new section edits no central file."""

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
    """Base of a method's config section (a frozen dataclass of ``setting`` fields) at ``method.<key>.*``, with its
    one-line ``help``. ``problems`` checks its own values, each problem starting with the key relative to the
    section (``"lambda: expected a value in [0, 1], got 1.5"``); checks that need other sections belong to the
    method's ``MethodSpec.validate``."""

    key: str = ""
    help: str = ""

    def problems(self) -> list[str]:
        return []
