"""Pins every direct dependency of eslm at the lowest version pyproject.toml allows, for .ci/lowest.

    python .ci/lowest_versions.py [EXTRA ...]           # a pip constraints file on stdout: name==lower-bound
    python .ci/lowest_versions.py --check [EXTRA ...]   # the installed versions against those pins (exit 1 if off)

Every direct dependency (the core list and the named extras) must have a lower bound (>=); one without is an
error, so the check cannot silently skip it. The bounds that cannot be installed here are listed in NOT_PINNED
with the reason; they appear as comments in the output, so the CI log says what the check does not cover.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

NOT_PINNED = {
    "torch": "only the CPU build of the tested version (constraints/cpu.txt) is installable offline here; "
             "PyPI's wheels of older versions are CUDA builds of several GB. torch's lower bound is not tested",
    "setuptools": "torch 2.13 itself requires setuptools>=77.0.3 (this bound, the first with SPDX license strings); "
                  "the newer one torch brings is kept",
}

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def direct_requirements(extras: list[str], pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{normalised name: lower bound} of the core dependencies and those of ``extras``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"lowest_versions: expected extras among {', '.join(optional)}; found {unknown}")
    floors: dict[str, str] = {}
    for req in [*project["dependencies"], *(r for e in extras for r in optional[e])]:
        match = _REQ.match(req)
        name, spec = _name(match.group(1)), match.group(3)
        if name == "eslm":  # an extra made of other extras ("all")
            continue
        bound = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if not bound:
            raise SystemExit(f"lowest_versions: expected a lower bound (>=) on every direct dependency; found "
                             f"{req!r}; fix: give it one in pyproject.toml")
        if floors.get(name, bound.group(1)) != bound.group(1):
            raise SystemExit(f"lowest_versions: expected one lower bound for {name}; found "
                             f"{floors[name]} and {bound.group(1)}; fix: make them equal in pyproject.toml")
        floors[name] = bound.group(1)
    return floors


def constraints(extras: list[str]) -> str:
    lines = []
    for name, floor in direct_requirements(extras).items():
        if name in NOT_PINNED:
            lines.append(f"# {name}>={floor} not pinned: {NOT_PINNED[name]}")
        else:
            lines.append(f"{name}=={floor}")
    return "\n".join(lines) + "\n"


def check(extras: list[str]) -> int:
    """Print each direct dependency's installed version next to its lower bound; 1 if a pinned one differs."""
    from importlib.metadata import PackageNotFoundError, version

    bad = 0
    for name, floor in direct_requirements(extras).items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "missing"
        pinned = name not in NOT_PINNED
        same = have != "missing" and _release(have) == _release(floor)
        verdict = "at its lower bound" if same else ("DIFFERS" if pinned else "(not pinned)")
        bad += pinned and not same
        print(f"  {name:<12} lower bound {floor:<8} installed {have:<14} {verdict}")
    return 1 if bad else 0


def _release(v: str) -> tuple[int, ...]:
    """'1.24' and '1.24.0' are the same release; '2.13.0+cpu' is 2.13.0."""
    parts = [int(p) for p in re.findall(r"\d+", v.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--check"]:
        sys.exit(check(args[1:]))
    sys.stdout.write(constraints(args))
