"""Versions of the installed packages that can change a number of a run (recorded in env.json)."""

from __future__ import annotations

# distribution name -> key in env.json's "versions"
DEPENDENCIES = {"torch": "torch", "numpy": "numpy", "tiktoken": "tiktoken", "transformers": "transformers",
                "lm_eval": "lm-eval", "datasets": "datasets", "safetensors": "safetensors"}


def dependency_versions() -> dict[str, str | None]:
    """{package: version or None when not installed}, read from the installed metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist, key in DEPENDENCIES.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = None
    return out
