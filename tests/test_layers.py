"""Import layering (docs/architecture.md: "Imports only point down the layers"): every import of ``src/eslm`` — function-local ones
included — points down the layer table below or stays within a layer, and no set of modules imports itself
around a loop. Imports under ``if TYPE_CHECKING:`` count like any other: an annotation that names a higher layer's
type is the lower layer knowing that layer (the model must not know the application's Config). The commands are the
top layer, the package ``eslm.cli``, one module per command; nothing below it imports argparse."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "eslm"

# module (or package) prefix -> layer; the longest matching prefix wins. Lower numbers are lower layers.
LAYERS = {
    "eslm": 0, "eslm.errors": 0, "eslm.metrics": 0,
    "eslm.settings": 0,  # setting() / Section: every method's config section is built from it, at any layer
    "eslm.ops": 1,
    "eslm.model": 2, "eslm.data": 2,
    "eslm.selection": 3, "eslm.objectives": 3, "eslm.contracts": 3,
    "eslm.baselines": 4,
    "eslm.methods": 5, "eslm.flops": 5, "eslm.api": 5,
    "eslm.eval.val_loss": 5,  # the validation loss the trainer reports (the rest of eval, lm-eval, sits above train)
    "eslm.integrations": 6,  # adapters to other trainers (HF, TRL, Lightning, torchtitan-style) over eslm.api
    "eslm.config": 6,  # the typed config validates method names and presets, so it sits above the registry
    "eslm.train": 7,
    "eslm.eval": 8, "eslm.analysis": 8,
    "eslm.study": 9,
    "eslm.cli": 10,  # the commands: eslm/cli/<command>.py, each calling one library function
}

# (importer, imported): upward imports still to be removed, each with its reason (none left)
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    base = SRC.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(tree: ast.AST, package: str) -> set[str]:
    """eslm modules imported anywhere in the tree (``from eslm.x import y`` counts as eslm.x.y when that is a
    module), ``if TYPE_CHECKING:`` blocks included."""
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "eslm")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([mod] if mod else []))
            if mod.split(".")[0] == "eslm":
                for a in node.names:
                    out.add(f"{mod}.{a.name}" if _exists(f"{mod}.{a.name}") else mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _trees() -> dict[str, tuple[ast.AST, str]]:
    """module name -> (syntax tree, package of its relative imports)"""
    out = {}
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        out[name] = (ast.parse(path.read_text()), name if path.name == "__init__.py" else name.rpartition(".")[0])
    return out


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(tree, package) if m != name} for name, (tree, package) in _trees().items()}


def argparse_importers(trees: dict[str, ast.AST]) -> list[str]:
    """Modules outside the commands package ``eslm.cli`` that import argparse anywhere (the command line's
    arguments belong to the commands; a library function takes plain typed parameters)."""
    def imports_argparse(tree):
        return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in n.names)
                   or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "argparse"
                   for n in ast.walk(tree))

    return sorted(name for name, tree in trees.items()
                  if not (name == "eslm.cli" or name.startswith("eslm.cli.")) and imports_argparse(tree))


def layer_of(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def upward_imports(graph) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, deps in graph.items() for b in deps
                  if layer_of(b) > layer_of(a) and (a, b) not in KNOWN_EXCEPTIONS)


def import_loops(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_every_module_has_a_layer():
    assert all(layer_of(m) >= 0 for m in _graph())


def test_no_upward_import():
    assert upward_imports(_graph()) == []


def test_no_import_loop():
    assert import_loops(_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_loop():
    graph = {"eslm.ops.fused_head": {"eslm.objectives.cross_entropy"},
             "eslm.objectives.cross_entropy": {"eslm.ops.fused_head"}}
    assert upward_imports(graph) == ["eslm.ops.fused_head (layer 1) imports eslm.objectives.cross_entropy (layer 3)"]
    assert import_loops(graph) == [["eslm.objectives.cross_entropy", "eslm.ops.fused_head"]]


def test_function_local_type_checking_and_package_imports_are_seen():
    tree = ast.parse("def f():\n    from eslm.selection import risk\n    import eslm.flops\n"
                     "if TYPE_CHECKING:\n    from eslm.train import trainer\n")
    assert _imports(tree, "eslm.x") == {"eslm.selection.risk", "eslm.flops", "eslm.train.trainer"}


def test_a_planted_upward_type_checking_import_fails():
    # the arrow issue 31 found: the model naming the application's Config for an annotation
    tree, package = _trees()["eslm.model.gpt"]
    planted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eslm.config import Config\n")
    tree = ast.Module(body=[*tree.body, *planted.body], type_ignores=[])
    graph = {**_graph(), "eslm.model.gpt": _imports(tree, package)}
    assert upward_imports(graph) == ["eslm.model.gpt (layer 2) imports eslm.config (layer 6)"]
    assert any("eslm.model.gpt" in loop and "eslm.config" in loop for loop in import_loops(graph))


# Imports of eslm modules inside a function, each with the reason it cannot be at the module's top: a true import
# cycle that cannot be broken, or a heavy optional path. "module:function" -> reason. (Optional extras such as
# matplotlib or lm_eval are third-party imports, imported where used; they are not listed here.)
LOCAL_IMPORTS: dict[str, str] = {}


def local_eslm_imports(trees: dict[str, tuple[ast.AST, str]]) -> list[str]:
    """"module:function: statement" for every import of an eslm module (absolute or relative) inside a function
    that ``LOCAL_IMPORTS`` does not list: an import at the module's top shows the dependency to a reader (and to
    the checks above) where a function-local one hides it."""
    out = []
    for name, (tree, _) in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                local = (isinstance(node, ast.ImportFrom)
                         and (node.level or (node.module or "").split(".")[0] == "eslm")
                         or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "eslm" for a in node.names))
                if local and f"{name}:{fn.name}" not in LOCAL_IMPORTS:
                    out.append(f"{name}:{fn.name}: {ast.unparse(node)}")
    return sorted(set(out))


def test_eslm_modules_are_imported_at_the_top():
    assert local_eslm_imports(_trees()) == [], "move these imports to the module's top (or list them, with why)"
    assert all(reason.strip() for reason in LOCAL_IMPORTS.values())


def test_a_planted_function_local_import_fails():
    trees = {"eslm.study.grid": (ast.parse(
        "import torch\ndef plan():\n    from eslm.config import build_config\n    import eslm.files\n"
        "def stages():\n    from . import shared\n    from torch import nn\n"), "eslm.study")}
    assert local_eslm_imports(trees) == ["eslm.study.grid:plan: from eslm.config import build_config",
                                         "eslm.study.grid:plan: import eslm.files",
                                         "eslm.study.grid:stages: from . import shared"]


def test_only_the_commands_import_argparse():
    assert argparse_importers({name: tree for name, (tree, _) in _trees().items()}) == []


def test_the_argparse_check_catches_an_import():
    trees = {"eslm.study": ast.parse("def f():\n    from argparse import Namespace\n"),
             "eslm.cli.study": ast.parse("import argparse\n"), "eslm.cli": ast.parse("import argparse\n"),
             "eslm.eval.tasks": ast.parse("import argparse as ap\n"), "eslm.sample": ast.parse("import torch\n")}
    assert argparse_importers(trees) == ["eslm.eval.tasks", "eslm.study"]


def test_every_command_is_its_own_module_of_the_commands_package():
    from eslm.cli import COMMANDS

    for name, (module, _) in COMMANDS.items():
        assert module == "eslm.cli." + name.replace("-", "_") and _exists(module), (name, module)


def stale_references(src: Path) -> list[str]:
    """Every ``eslm.<module>...`` name and every ``eslm/...py`` / ``docs/...md`` path written in the package's
    text (docstrings, comments, messages) that does not exist: a moved or deleted function leaves text that lies.
    Names are checked when their first part is one of eslm's own modules (``eslm.remove()`` in an example is a
    variable, not a module)."""
    import importlib
    import re

    top = {p.stem for p in src.glob("*.py")} | {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    out = []

    def module_file(module: str) -> Path | None:
        """The source file of an eslm module, found without importing it."""
        base = src.parent.joinpath(*module.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    def defined_in_source(file: Path, name: str) -> bool:
        """``name`` is defined at the top of ``file`` (read, not imported)."""
        import ast

        for node in ast.parse(file.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
        return False

    def resolves(dotted: str) -> bool:
        parts = dotted.split(".")
        for i in range(len(parts), 1, -1):
            module = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module)
            except ImportError:
                file = module_file(module)
                if file is None:
                    continue
                # the module exists but cannot be imported here: it needs an extra that is not installed
                # (transformers for eslm.integrations.hf). Read its first named attribute from its source.
                return len(parts) == i or defined_in_source(file, parts[i])
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    for path in sorted(src.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for ref in re.findall(r"\beslm(?:\.[A-Za-z_]\w*)+", line):
                if ref.split(".")[1] in top and not resolves(ref):
                    out.append(f"{path.relative_to(src)}:{n} {ref}")
            for rel in re.findall(r"\b(?:eslm/[\w/]+\.py|docs/\w+\.md)\b", line):
                target = src.parent / rel if rel.startswith("eslm/") else src.parents[1] / rel
                if not target.is_file():
                    out.append(f"{path.relative_to(src)}:{n} {rel}")
    return out


def test_the_package_names_only_what_exists():
    assert stale_references(SRC) == []


def test_module_docstrings_stay_short():
    # a module docstring says what the module does and points to docs/ for essays and measured figures (a code
    # change silently falsifies a figure kept beside the code); GREATS' held 86 lines
    long = {}
    for path in sorted(SRC.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > 45:
            long[str(path.relative_to(SRC))] = len(doc.splitlines())
    assert long == {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(trees: dict[str, tuple[ast.AST, str]]) -> list[str]:
    """Private names (``_name``) one eslm module takes from another: ``from eslm.x import _name`` (relative
    imports too), and ``alias._name`` where ``alias`` was bound by an import of an eslm module or of a name from
    one (``from eslm.ops import fused_head`` then ``fused_head._helper``; ``import eslm.x as x`` then ``x._y``).
    A helper two modules share gets a public name in the module that owns it."""
    out = []
    for name, (tree, package) in sorted(trees.items()):
        bound: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                bound.update(a.asname or a.name.split(".")[0] for a in n.names if a.name.split(".")[0] == "eslm")
            elif isinstance(n, ast.ImportFrom):
                mod = n.module or ""
                if n.level:
                    mod = ".".join(package.split(".")[: len(package.split(".")) - n.level + 1] + ([mod] if mod else []))
                if mod.split(".")[0] != "eslm" or mod == name:
                    continue
                bound.update(a.asname or a.name for a in n.names)
                out += [f"{name}: from {mod} import {a.name}" for a in n.names if _private(a.name)]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr):
                base = n.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in bound:
                    out.append(f"{name}: {ast.unparse(n)}")
    return sorted(out)


def test_no_private_name_crosses_modules():
    assert private_imports(_trees()) == []


def test_the_private_name_check_catches_an_import_and_an_attribute():
    planted = {"eslm.ops.triton_head": (ast.parse("from eslm.ops.fused_head import _helper, public\n"
                                                  "from . import naive_head as nh\nimport eslm.ops.token_stats\n"
                                                  "x = nh._rows(1) + eslm.ops._y + public._z + nh.__name__"),
                                        "eslm.ops"),
               "eslm.ops.fused_head": (ast.parse("def _helper(): pass\n_helper()"), "eslm.ops")}
    assert private_imports(planted) == ["eslm.ops.triton_head: eslm.ops._y",
                                        "eslm.ops.triton_head: from eslm.ops.fused_head import _helper",
                                        "eslm.ops.triton_head: nh._rows", "eslm.ops.triton_head: public._z"]


def unused_public_definitions(root: Path) -> list[str]:
    """Module-level public functions and classes of ``eslm`` that nothing uses: no reference in the package, the
    benchmarks or the examples other than their own definition, and no mention in docs/ or README.md (a documented
    function is used by its readers). Tests do not count: a function only a test calls is code kept alive by its
    test and belongs in the test. The public API packages (eslm.api, eslm.integrations) are used by their users,
    and each command module's add_arguments / run by the dispatcher (eslm.cli.COMMANDS)."""
    import re

    src = root / "src" / "eslm"
    users = [*src.rglob("*.py"), *(root / "benchmarks").rglob("*.py"), *(root / "examples").rglob("*.py")]
    docs = "\n".join(p.read_text() for p in [root / "README.md", *(root / "docs").glob("*.md")])
    refs = set()
    for path in users:
        tree = ast.parse(path.read_text())
        here = _module_name(path) if path.is_relative_to(src) else ""
        alias = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                alias.update({a.asname or a.name.split(".")[0]: a.asname and a.name or a.name.split(".")[0]
                              for a in n.names})
            elif isinstance(n, ast.ImportFrom) and n.module:
                mod = n.module if not n.level else ".".join(
                    here.split(".")[:len(here.split(".")) - n.level + (path.name == "__init__.py")] + [n.module])
                for a in n.names:
                    if _exists(f"{mod}.{a.name}"):
                        alias[a.asname or a.name] = f"{mod}.{a.name}"
                    else:
                        refs.add(f"{mod}.{a.name}")
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                chain, v = [n.attr], n.value
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id in alias:
                    parts = [alias[v.id], *reversed(chain)]
                    refs.update(".".join(parts[:i + 1]) for i in range(1, len(parts)))
            elif isinstance(n, ast.Name) and here:
                refs.add(f"{here}.{n.id}")
    # a head backend is reached through its registry line, BackendSpec(name, module, class, ...): that line uses it
    for n in ast.walk(ast.parse((src / "ops" / "head_backend.py").read_text())):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "BackendSpec":
            refs.add(f"{n.args[1].value}.{n.args[2].value}")
    out = []
    for path in sorted(src.rglob("*.py")):
        mod = _module_name(path)
        if mod.startswith(("eslm.api", "eslm.integrations")):
            continue
        for n in ast.parse(path.read_text()).body:
            if not isinstance(n, (ast.FunctionDef, ast.ClassDef)) or n.name.startswith("_"):
                continue
            if mod.startswith("eslm.cli.") and n.name in ("add_arguments", "run"):
                continue
            if f"{mod}.{n.name}" not in refs and not re.search(rf"\b{n.name}\(|{re.escape(mod)}\.{n.name}\b", docs):
                out.append(f"{mod}.{n.name}")
    return out


def test_every_public_function_is_used():
    assert unused_public_definitions(SRC.parents[1]) == []
