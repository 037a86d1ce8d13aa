"""User-facing errors: one line that says what was expected, what was found and how to fix it."""

import errno


class ESLMError(Exception):
    """An error caused by the user's input (config, data, checkpoint). The CLI prints it as one line."""


class ConfigError(ESLMError):
    """One or more invalid config values; the message lists every problem, one per line. ``problems`` holds the
    lines themselves (a study names the runs each one concerns), or just the message."""

    def __init__(self, message: str = "", problems: tuple[str, ...] = ()):
        super().__init__(message)
        self.problems = problems or (message,)


class DataError(ESLMError):
    """Missing, corrupt or mismatched data."""


class CheckpointError(ESLMError):
    """A checkpoint that cannot be loaded into this model or run."""


def os_error_line(e: OSError) -> str:
    """One line for an OS error that reached the command line: what failed, on which file, how to fix it."""
    where = f" {e.filename!r}" if e.filename is not None else ""
    if e.filename2 is not None:
        where += f" -> {e.filename2!r}"
    fixes = {
        errno.EACCES: "make it writable/readable for this user or choose another location",
        errno.EPERM: "make it writable/readable for this user or choose another location",
        errno.EROFS: "the file system is read-only: choose another location",
        errno.ENOSPC: "the disk is full: free space or choose another location",
        errno.EDQUOT: "the disk quota is exceeded: free space or choose another location",
        errno.ENOENT: "check the path (a parent directory may be missing)",
        errno.ENOTDIR: "a component of the path is a regular file, not a directory: choose another location",
        errno.EISDIR: "expected a file, found a directory: check the path",
        errno.EEXIST: "remove it or choose another location",
        errno.ENAMETOOLONG: "use a shorter path",
        errno.ELOOP: "it is a symbolic link where eslm writes a file of its own: remove the link",
        errno.EFBIG: "the file is larger than this file system or the process's file-size limit allows: "
                     "choose another location or raise the limit (ulimit -f)",
    }
    fix = fixes.get(e.errno or 0, "check the path and its permissions")
    return f"{e.strerror or type(e).__name__}:{where or ' (no file named)'}; {fix}"


# optional packages -> the eslm extra that installs them (pyproject.toml [project.optional-dependencies])
EXTRAS = {"transformers": "hf", "accelerate": "hf", "lm_eval": "eval", "matplotlib": "plot", "datasets": "data",
          "pyarrow": "data", "tensorboard": "tb", "wandb": "wandb", "trl": "trl", "pytorch_lightning": "lightning",
          "lightning": "lightning", "submitit": "slurm", "yaml": "train", "tiktoken": "train",
          "tiktoken_ext": "train", "tqdm": "train", "safetensors": "train", "jinja2": "train",
          "scipy": "train"}


def extra_of(module: str | None) -> str | None:
    """The eslm extra that installs ``module`` (a missing optional dependency), or None."""
    return EXTRAS.get((module or "").split(".")[0])


class OwnershipError(ESLMError):
    """A path eslm will not write: a directory another program made, or a symbolic link inside its own."""


def link_refused(path) -> OwnershipError:
    return OwnershipError(f"{str(path)!r} is a symbolic link; eslm never writes through a link inside its "
                          "directories (the write would change the link's target): remove the link")
