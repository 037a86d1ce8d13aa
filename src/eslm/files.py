"""The files eslm writes: names that stay inside their directory.

``name_problem`` / ``check_name``: a run name, a study name or a study label becomes one path component
(``<out_dir>/<name>``), so it is accepted only as a single, portable component: not empty, not ``.`` or ``..``,
no path separator, no control character, no leading dot (eslm's own temporary files start with one) or dash
(it would read as an option), no surrounding white space, at most ``MAX_NAME`` characters.
"""

from __future__ import annotations

from eslm.errors import ConfigError

MAX_NAME = 200  # characters; file systems allow 255 bytes per component, eslm adds suffixes to some names


def name_problem(value: object, what: str) -> str | None:
    """None when ``value`` is a path-safe single component, else one line: what was expected and found."""
    expected = (f"{what}: expected a single path-safe name (letters, digits, '-', '_', '.', no '/' or '\\', "
                f"not starting with '.' or '-')")
    if not isinstance(value, str):
        return f"{expected}, got {type(value).__name__} {value!r}"
    if not value:
        return f"{expected}, got an empty name"
    bad = None
    if value in (".", ".."):
        bad = "a reference to a directory, not a name"
    elif "/" in value or "\\" in value:
        bad = "a path separator"
    elif any(ord(c) < 32 or ord(c) == 127 for c in value):
        bad = "a control character"
    elif value[0] == ".":
        bad = "a leading '.' (hidden; eslm's temporary files start with one)"
    elif value[0] == "-":
        bad = "a leading '-' (it would read as an option)"
    elif value != value.strip():
        bad = "leading or trailing white space"
    elif len(value) > MAX_NAME:
        bad = f"{len(value)} characters (at most {MAX_NAME})"
    return None if bad is None else f"{expected}, got {value!r}: {bad}"


def check_name(value: object, what: str) -> str:
    """``value`` when it is a path-safe single component, else a one-line ConfigError (``name_problem``)."""
    problem = name_problem(value, what)
    if problem:
        raise ConfigError(problem)
    return value  # type: ignore[return-value]
