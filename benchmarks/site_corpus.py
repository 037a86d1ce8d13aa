"""The 124M GPU pilot's corpus, built on the GPU machine itself (it has no internet): the Python sources of the
packages installed for the running interpreter (its site-packages), deduplicated by content, split into three
domains by top-level package, then prepared by ``eslm prepare text``.

    PYTHONPATH=src python benchmarks/site_corpus.py --out data/site-gpt2 [--max-mb 240] [--tokenizer gpt2]

Domains (a package goes to the first that names it; the rest is ``tools``):

* ``torch``    torch, torchgen, functorch, triton and NVIDIA's Python packages: the framework's own code;
* ``science``  numpy, scipy, sympy, mpmath, networkx, pandas, sklearn, matplotlib: numerical libraries;
* ``tools``    everything else (pip, setuptools, jinja2, yaml, filelock, ...).

Test directories (``test``, ``tests``), caches and ``*.dist-info`` are left out; a file whose bytes already
appeared (vendored copies, the same module in two environments) is kept once; files over 1 MB (generated tables)
and files that are not UTF-8 are skipped. Each domain takes at most ``--max-mb`` / 3 MB, in sorted path order,
so the corpus is the same on two machines with the same packages. The chosen files are copied into
``OUT.src/<domain>/`` (the text source reads a directory per domain), and ``OUT.src/corpus.json`` records what
was kept, skipped and deduplicated per domain, with the package list. The study file that trains on it is
``configs/studies/pilots/pilot-124m-gpu.yaml``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = {
    "torch": ("torch", "torchgen", "functorch", "triton", "nvidia"),
    "science": ("numpy", "scipy", "sympy", "mpmath", "networkx", "pandas", "sklearn", "matplotlib"),
}
OTHER = "tools"
SKIP_DIRS = {"test", "tests", "__pycache__", "testing"}
MAX_FILE_BYTES = 1 << 20


def site_dirs() -> list[Path]:
    """The running interpreter's package directories, each once."""
    cands = [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"), *site.getsitepackages()]
    out: list[Path] = []
    for c in cands:
        if c and Path(c).is_dir() and Path(c).resolve() not in out:
            out.append(Path(c).resolve())
    return out


def domain_of(package: str) -> str:
    top = package.split(".")[0].lower()
    return next((d for d, names in DOMAINS.items() if top in names), OTHER)


def python_files(roots: list[Path]) -> list[tuple[str, Path]]:
    """(top-level package, file) of every .py file under ``roots``, in sorted order."""
    out = []
    for root in roots:
        for entry in sorted(root.iterdir()):
            if entry.name.endswith((".dist-info", ".egg-info")) or entry.name.startswith((".", "_")):
                continue
            if entry.is_file() and entry.suffix == ".py":
                out.append((entry.stem, entry))
            elif entry.is_dir():
                for dirpath, dirnames, filenames in os.walk(entry):
                    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
                    out += [(entry.name, Path(dirpath) / f) for f in sorted(filenames) if f.endswith(".py")]
    return out


def select(files: list[tuple[str, Path]], max_bytes_per_domain: int) -> tuple[dict, dict]:
    """({domain: [(package, file)]} kept, per-domain counts), duplicates by content dropped: the domains are read
    in order (torch, science, tools), so a package's own file is kept and a copy vendored elsewhere dropped."""
    seen: set[str] = set()
    kept: dict[str, list[tuple[str, Path]]] = {d: [] for d in [*DOMAINS, OTHER]}
    order = list(kept)
    files = sorted(files, key=lambda item: order.index(domain_of(item[0])))  # stable: paths stay sorted
    stats = {d: {"files": 0, "bytes": 0, "duplicates": 0, "too_large": 0, "not_utf8": 0, "over_cap": 0}
             for d in kept}
    for package, path in files:
        d = domain_of(package)
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) > MAX_FILE_BYTES:
            stats[d]["too_large"] += 1
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            stats[d]["duplicates"] += 1
            continue
        seen.add(digest)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            stats[d]["not_utf8"] += 1
            continue
        if not data.strip():
            continue
        if stats[d]["bytes"] + len(data) > max_bytes_per_domain:
            stats[d]["over_cap"] += 1
            continue
        kept[d].append((package, path))
        stats[d]["files"] += 1
        stats[d]["bytes"] += len(data)
    return kept, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the prepared corpus (eslm prepare's --out)")
    p.add_argument("--max-mb", type=float, default=240.0, help="source bytes in all, split evenly over domains")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--roots", type=Path, nargs="*", default=None, help="package directories (default: site's)")
    p.add_argument("--no-prepare", action="store_true", help="copy the sources only")
    a = p.parse_args(argv)
    src = a.out.with_name(a.out.name + ".src")
    if src.exists() and not (src / "corpus.json").is_file():
        print(f"site_corpus: error: {src} exists and was not written by this script (no corpus.json); "
              "choose another --out", file=sys.stderr)
        return 2
    roots = a.roots or site_dirs()
    kept, stats = select(python_files(roots), int(a.max_mb * 1e6 / (len(DOMAINS) + 1)))
    shutil.rmtree(src, ignore_errors=True)
    for d, items in kept.items():
        for _, path in items:
            rel = path.relative_to(next(r for r in roots if path.is_relative_to(r)))
            dest = src / d / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    domains = [d for d, items in kept.items() if items]
    packages = sorted({pkg for items in kept.values() for pkg, _ in items})
    (src / "corpus.json").write_text(json.dumps({"roots": [str(r) for r in roots], "python": sys.version.split()[0],
                                                 "domains": stats, "packages": packages}, indent=2) + "\n")
    for d in kept:
        print(f"{d}: {stats[d]['files']} files, {stats[d]['bytes'] / 1e6:.1f} MB ({stats[d]['duplicates']} "
              f"duplicates, {stats[d]['too_large']} over 1 MB, {stats[d]['over_cap']} over the cap dropped)")
    if a.no_prepare:
        return 0
    cmd = [sys.executable, "-m", "eslm.cli", "prepare", "text", "--out", str(a.out), "--tokenizer", a.tokenizer,
           "--force", *[f"{d}={src / d}" for d in domains]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
