"""User-facing errors: one line that says what was expected, what was found and how to fix it."""


class ESLMError(Exception):
    """An error caused by the user's input (config, data, checkpoint). The CLI prints it as one line."""


class ConfigError(ESLMError):
    """One or more invalid config values; the message lists every problem."""


class DataError(ESLMError):
    """Missing, corrupt or mismatched data."""


class CheckpointError(ESLMError):
    """A checkpoint that cannot be loaded into this model or run."""
