"""The error a user's configuration raises: a leaf module, so any layer can raise it without import cycles."""


class ConfigError(ValueError):
    """A bad flag, config value or input file; the message names the flag (or file) and the fix.

    Entry points print it once, on rank 0, and exit with status 2 (`cp_ext.arguments.exit_with_config_error`)."""
