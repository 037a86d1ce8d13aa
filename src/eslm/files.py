"""The files eslm writes: names that stay inside their directory (``name_problem``), writes that never follow a
link (``open_nofollow``, ``atomic_write``: a rename replaces a link, ``ensure_dir``), checksums
(``<file>.sha256`` in ``sha256sum`` format), ownership markers (a JSON object with a ``format`` and a random
``id``: eslm deletes, prunes or overwrites only what its marker or its names prove it made) and the one YAML
reader (``read_yaml``)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
import unicodedata
import uuid
from contextlib import contextmanager
from pathlib import Path

import eslm
from eslm.errors import ConfigError, OwnershipError, link_refused  # noqa: F401  (files.link_refused)
from eslm.lock import DirLock

MAX_NAME = 200  # characters; file systems allow 255 bytes per component, eslm adds suffixes to some names
_NOT_PORTABLE = ':*?"<>|'
_DEVICE_NAMES = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_NAME_RULES = (  # (whether a name has it, what it is), the first that holds is named
    (lambda v: v in (".", ".."), "a reference to a directory, not a name"),
    (lambda v: "/" in v or "\\" in v, "a path separator"),
    (lambda v: any(ord(c) < 32 or ord(c) == 127 for c in v), "a control character"),
    (lambda v: any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") for c in v),
     "an invisible or formatting character (e.g. a right-to-left override)"),
    (lambda v: any(c in _NOT_PORTABLE for c in v),
     f"a character that Windows and many tools refuse in file names ({_NOT_PORTABLE})"),
    (lambda v: v.split(".")[0].upper().rstrip() in _DEVICE_NAMES, "a reserved device name on Windows"),
    (lambda v: v[0] == ".", "a leading '.' (hidden; eslm's temporary files start with one)"),
    (lambda v: v[0] == "-", "a leading '-' (it would read as an option)"),
    (lambda v: v != v.strip(), "leading or trailing white space"),
)


def name_problem(value: object, what: str) -> str | None:
    """None when ``value`` is a path-safe single component, else one line: what was expected and found."""
    expected = (f"{what}: expected a single path-safe name (letters, digits and punctuation other than "
                f"{_NOT_PORTABLE} and '/', not starting with '.' or '-', not a device name such as CON)")
    if not isinstance(value, str):
        return f"{expected}, got {type(value).__name__} {value!r}"
    if not value:
        return f"{expected}, got an empty name"
    bad = next((what for has, what in _NAME_RULES if has(value)), None)
    if bad is None and len(value) > MAX_NAME:
        bad = f"{len(value)} characters (at most {MAX_NAME})"
    return None if bad is None else f"{expected}, got {value!r}: {bad}"


# ------------------------------------------------------------------ writes that never follow a symbolic link


def ensure_dir(path: Path) -> Path:
    """Create the directory ``path`` (and its parents); refuse when it is a symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise link_refused(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR}


def open_nofollow(path: Path, mode: str = "a", **kwargs):
    """``open(path, mode)`` for writing ("w", "a", "r+", with "b" for bytes) that refuses a symbolic link as
    the file itself (``O_NOFOLLOW``) instead of writing to its target."""
    flags = _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(Path(path)) from None
        raise
    return os.fdopen(fd, mode, **kwargs)


def temp_of(name: str) -> str | None:
    """The file name whose atomic write left the temporary file ``name``, or None if ``name`` is not one."""
    m = re.match(r"^\.(.+)\.tmp\.\d+$", name)
    return m.group(1) if m else None


class _HashingWriter:
    """A file object that hashes what passes through it and keeps the OSError a writer (torch's zip writer)
    may turn into another exception."""

    def __init__(self, f):
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        return n

    def fileno(self) -> int:
        return self.f.fileno()

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = e
            raise


def atomic_write(path: Path, write, before_rename=None) -> str:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, fsync, rename, fsync the directory:
    a kill leaves the old file or the new one, never a torn one, and a symbolic link at ``path`` is replaced,
    never followed. ``write`` may be bytes. Returns the SHA-256 of what was written; ``before_rename(sha256)``
    is called once the temporary file is complete (a checksum written before the file takes its name).

    On any failure the temporary file is removed (it may be GBs) and the error raised as an ``OSError`` naming
    ``path``, also when a writer turned it into another exception (torch's zip writer makes it a RuntimeError)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")  # temp_of(tmp.name) is path.name
    tmp.unlink(missing_ok=True)  # left by an earlier process of the same PID (a kill): ours by its name
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            hw = _HashingWriter(f)
            try:
                if isinstance(write, (bytes, bytearray)):
                    hw.write(write)
                else:
                    write(hw)
                hw.flush()
            except Exception as e:
                if hw.error is not None and not isinstance(e, OSError):
                    raise _with_name(hw.error, path) from None
                raise
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(hw.sha.hexdigest())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, a permission error, a kill signal: no partial file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _with_name(e, path) from None
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself made durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return hw.sha.hexdigest()


def stale_temporaries(directory: Path, own) -> list[Path]:
    """The temporary files (``.NAME.tmp.PID``, ``temp_of``) in ``directory`` of names ``own(name)`` claims: left by
    a killed or failed write. Remove them only while holding the directory's lock (no live process writes them)."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return []
    return sorted(p for p in directory.iterdir() if (target := temp_of(p.name)) is not None and own(target)
                  and not p.is_dir())


@contextmanager
def named(path):
    """``with named(path):`` an OSError raised in the block without a file name (a write or flush of an open
    file: a full disk) is raised again naming ``path``."""
    try:
        yield
    except OSError as e:
        raise _with_name(e, Path(path)) from None


def _with_name(e: OSError, path: Path) -> OSError:
    return e if e.filename is not None else OSError(e.errno, e.strerror or str(e), str(path))


def os_error_in(e: BaseException, path: Path) -> OSError | None:
    """The OSError inside an exception of a library that reports it as text (safetensors: "... (os error 28)"),
    naming ``path``; None when there is none."""
    if isinstance(e, OSError):
        return _with_name(e, path)
    m = re.search(r"os error (\d+)|code: (\d+)", str(e))
    if not m:
        return None
    code = int(m.group(1) or m.group(2))
    return OSError(code, os.strerror(code), str(path))


# ------------------------------------------------------------------ checksums: <file>.sha256 beside a file

CHECKSUM_SUFFIX = ".sha256"


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB blocks (checkpoints, snapshots, data shards)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def checksum_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + CHECKSUM_SUFFIX)


def read_checksums(path: Path) -> list[str] | None:
    """The SHA-256 values the sidecar ``<path>.sha256`` accepts for ``path`` (``sha256sum`` lines; two while a
    file is being replaced), None when there is no sidecar."""
    side = checksum_path(path)
    try:
        text = side.read_text()
    except FileNotFoundError:
        return None
    return [line.split()[0].lower() for line in text.splitlines() if line.strip()]


def write_checksums(path: Path, hexes: list[str]) -> None:
    atomic_write(checksum_path(path), "".join(f"{h}  {Path(path).name}\n" for h in hexes).encode())


def verify_checksum(path: Path) -> bool | None:
    """True when ``path`` matches its sidecar, False when not, None when it has none (an older eslm's file)."""
    accepted = read_checksums(path)
    if accepted is None:
        return None
    return sha256_file(path) in accepted


# ------------------------------------------------------------------ ownership markers

RUN_MARKER, RUN_FORMAT = "eslm-run.json", "eslm-run-v1"  # in every run directory (eslm.train.run_dir)


def new_marker(fmt: str, **extra) -> dict:
    """The content of a marker file: the format, a random id, when and by which eslm it was made."""
    return {"format": fmt, "id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "eslm_version": eslm.__version__, **extra}


def read_marker(path: Path, fmt: str) -> dict | None:
    """The marker at ``path`` when it is a JSON object of format ``fmt`` (not a link), else None."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("format") == fmt else None


def foreign_entries(directory: Path, ours) -> list[str]:
    """The names in ``directory`` that ``ours(name)`` does not claim, sorted."""
    return sorted(p.name for p in Path(directory).iterdir() if not ours(p.name))


def listing(names: list, n: int = 3, show=repr, sep: str = ", ") -> str:
    """'a, b, c and 4 more'"""
    return sep.join(show(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ------------------------------------------------------------------ the one YAML reader

MAX_YAML_DEPTH = 64  # nested mappings/lists; eslm's own files use at most 4
MAX_YAML_NODES = 100_000  # nodes after aliases are expanded (an "alias bomb" expands to billions)
MAX_YAML_BYTES = 16 << 20


class YAMLProblem(ValueError):
    """What is wrong with a YAML text, one line (``read_yaml`` adds the file and the fix)."""


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses duplicate keys."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue
                    key = self.construct_object(key_node, deep=True)
                    if key in seen:
                        raise YAMLProblem(f"the key {key!r} appears twice (lines {seen[key]} and "
                                          f"{key_node.start_mark.line + 1}); YAML would silently keep the last")
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return Loader


def yaml_events(text: str):
    """The parse events of a YAML text, from libyaml where installed (C, about 30x faster than PyYAML's Python
    parser, which spends a minute on a million values). Iterative: no depth limit needed."""
    import yaml

    return yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def yaml_list_lengths(text: str) -> dict:
    """The number of items of each top-level key's list (``{key: n}``) in a YAML mapping, counted from
    ``yaml_events`` without building a value; {} for a text that cannot be parsed."""
    import yaml

    try:
        return _list_lengths(yaml_events(text))
    except yaml.YAMLError:
        return {}


def _list_lengths(events) -> dict:
    import yaml

    out: dict = {}
    depth, key, items = 0, None, 0
    for e in events:
        if depth == 1 and key is None and isinstance(e, yaml.ScalarEvent):
            key = e.value
            continue
        if depth == 2 and key is not None and isinstance(e, (yaml.NodeEvent, yaml.CollectionStartEvent)):
            items += 1  # an item of the list (its start, for a nested collection)
        if isinstance(e, yaml.CollectionStartEvent):
            depth += 1
            if depth == 2 and key is not None and not isinstance(e, yaml.SequenceStartEvent):
                key = None  # a mapping value: not counted (depth 2 then belongs to no list)
        elif isinstance(e, yaml.CollectionEndEvent):
            depth -= 1
            if depth == 1:
                if key is not None:
                    out[key] = items
                key, items = None, 0
        elif depth == 1 and isinstance(e, (yaml.ScalarEvent, yaml.AliasEvent)):
            key = None  # a scalar value
    return out


def _size_problem(text: str) -> str | None:
    """More than ``MAX_YAML_NODES`` values as written or once aliases are expanded (an alias bomb; a recursive
    alias counts as too many), or nesting deeper than ``MAX_YAML_DEPTH``: found in ``yaml_events`` before anything
    is built, and stopped there. None also for a syntax error (the loader, next, says what is wrong)."""
    import yaml

    written = expanded = 0
    open_at: list = []  # (anchor, expanded count before it) of each open collection
    sizes: dict = {}  # anchor -> the values it stands for
    try:
        for e in yaml_events(text):
            if isinstance(e, yaml.CollectionEndEvent):
                anchor, before = open_at.pop()
                if anchor is not None:
                    sizes[anchor] = expanded - before
            elif isinstance(e, yaml.AliasEvent):
                expanded += sizes.get(e.anchor, 1)
            elif isinstance(e, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                if len(open_at) >= MAX_YAML_DEPTH:  # every node one level below its parent
                    return f"nesting deeper than {MAX_YAML_DEPTH} levels at line {e.start_mark.line + 1}"
                written, expanded = written + 1, expanded + 1
                if isinstance(e, yaml.CollectionStartEvent):
                    open_at.append((e.anchor, expanded - 1))
                if e.anchor is not None:  # a collection's own alias inside it is recursive: too many
                    sizes[e.anchor] = 1 if isinstance(e, yaml.ScalarEvent) else MAX_YAML_NODES + 1
                if written > MAX_YAML_NODES:
                    return (f"expected at most {MAX_YAML_NODES} values, found more (line {e.start_mark.line + 1});"
                            " eslm's files hold a few hundred")
            if expanded > MAX_YAML_NODES:
                return f"more than {MAX_YAML_NODES} values once its aliases (*name) are expanded"
    except yaml.YAMLError:
        pass
    return None


def parse_yaml(text: str):
    """The value of a YAML text, safely: plain data only (SafeLoader), no duplicate keys, and within
    ``_size_problem``'s limits. Raises YAMLProblem (one line) for anything else, a syntax error included."""
    import yaml

    loader = _yaml_loader()(text)
    try:
        if (problem := _size_problem(text)) is not None:
            raise YAMLProblem(problem)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = "; ".join(x for x in (e.context, e.problem) if x)
        raise YAMLProblem(f"{what or type(e).__name__}{at}") from None
    except yaml.YAMLError as e:
        raise YAMLProblem(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except RecursionError:  # deeper than libyaml reads (1000 levels), so not seen by _size_problem
        raise YAMLProblem(f"nesting deeper than {MAX_YAML_DEPTH} levels") from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike, what: str = "YAML file", error=ConfigError, fix: str = "fix the file") -> dict:
    """The YAML mapping in the file at ``path`` read as UTF-8 through ``parse_yaml`` (the one YAML reader of eslm:
    configs, studies, run directories). Every problem is one ``error`` line naming ``what`` and the file and ending
    with ``fix``: not UTF-8, not valid YAML, duplicate keys, too deep, an alias bomb, too large, or not a mapping.
    An empty file is an empty mapping. OSErrors pass through (the command line names their file)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_YAML_BYTES + 1)
    where = f"{what} {str(path)!r}"
    if len(raw) > MAX_YAML_BYTES:
        raise error(f"{where}: expected at most {MAX_YAML_BYTES >> 20} MiB of YAML, found a larger file; {fix}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(f"{where}: expected UTF-8 text, found the byte 0x{raw[e.start]:02x} on line {line} (another "
                    f"encoding, e.g. Latin-1); save the file as UTF-8") from None
    try:
        data = parse_yaml(text)
    except YAMLProblem as e:
        raise error(f"{where} is not valid YAML for eslm: {e}; {fix}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping (key: value lines), found {type(data).__name__}; {fix}")
    return data


# ------------------------------------------------------------------ output directories written whole


def output_lock(out: Path, what: str):
    """The lock of an output directory eslm writes whole (report, export, token view, prepared data): a file
    beside it, ``.NAME.eslm.lock`` (the directory itself is replaced by a rename; its parent is created here)."""
    out = Path(out)
    return DirLock(out, what, path=ensure_dir(out.parent) / f".{out.name}.eslm.lock")


def check_output_dir(out: Path, what: str, is_ours, earlier: str = "an earlier output of the same command") -> None:
    """Refuse (one line) an output directory that is a link, a file, or holds files eslm cannot prove it wrote:
    ``is_ours(out)`` says whether its content is an earlier output of the same command."""
    out = Path(out)
    if out.is_symlink():
        raise link_refused(out)
    if out.exists() and not out.is_dir():
        raise OwnershipError(f"expected {what} {str(out)!r} to be a directory, found a file; choose another "
                             "output directory")
    if out.is_dir() and any(out.iterdir()) and not is_ours(out):
        raise OwnershipError(f"expected {what} {str(out)!r} to be new, empty or {earlier}, found other files ({listing(foreign_entries(out, lambda n: False))}); eslm "
                             "replaces only what it wrote: choose another output directory")


def check_forced_out(out: Path, what: str, ours: set[str] | None, force: bool) -> None:
    """Refuse (one ConfigError line) an --out directory unless it is new, empty, or ``what`` (an earlier output of
    the command, whose files ``ours`` names; None: not one) that ``force`` may replace and that holds nothing
    else; never a link (--force would empty its target) or a file."""
    if out.is_symlink():
        raise link_refused(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"expected --out to be a directory; found a file at {out}; fix: choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if ours is None:
        raise ConfigError(f"expected --out to be new, empty or {what}; found {out} holds files eslm did not "
                          f"write ({listing(foreign_entries(out, lambda n: False))}); fix: choose another --out "
                          "(eslm never overwrites what it did not make)")
    if not force:
        raise ConfigError(f"expected a new --out directory; found {what} in {out}; fix: pass --force to replace "
                          "it, or choose another --out")
    if foreign := foreign_entries(out, lambda n: n in ours):
        raise ConfigError(f"expected --force to replace {what}; found {out} also holds files eslm did not write "
                          f"({listing(foreign)}); fix: move them away, or choose another --out")


DIR_MARKER = ".eslm-output"  # inside a temporary or set-aside output directory: eslm made it


def replace_dir(out: Path, fill, *, what: str, is_ours, earlier: str = "an earlier output of the same command") -> None:
    """``swap_dir(out, fill)`` under ``output_lock`` (a concurrent writer of the same ``out`` is refused in one
    line) after ``check_output_dir``."""
    with output_lock(out, what).acquire():
        check_output_dir(out, what, is_ours, earlier)
        swap_dir(out, fill)


def swap_dir(out: Path, fill) -> None:
    """``fill(tmp)`` writes a temporary directory beside ``out`` (``.NAME.tmp.PID``), which then replaces ``out``
    in one rename; the previous output is set aside and deleted. Call under ``out``'s ``output_lock`` once ``out``
    is checked: leftovers of killed writers (eslm's marker inside) are removed. A failure leaves ``out`` as it was."""
    out = Path(out)
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)\.\d+$")
    for p in out.parent.iterdir():  # under the lock: no live writer owns them
        if pattern.match(p.name) and p.is_dir() and not p.is_symlink() and (p / DIR_MARKER).is_file():
            shutil.rmtree(p)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    tmp.mkdir()
    try:
        (tmp / DIR_MARKER).write_bytes(b"")
        with named(out):  # a full disk while a library writes a file of it (a figure): the output is named
            fill(tmp)
        (tmp / DIR_MARKER).unlink()
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.rename(out, old)
            (old / DIR_MARKER).write_bytes(b"")
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
