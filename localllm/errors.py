"""User-facing errors: one line that names the problem and the fix."""


class LocalLLMError(Exception):
    """An error caused by input the user can fix; the CLI prints it as one line, no traceback."""


class Cancelled(Exception):
    """Work stopped because the caller asked it to (generate's `cancel`)."""
