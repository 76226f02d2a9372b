"""User-facing errors: one line that names the problem and the fix; and the test of a whole-number argument the
checks before them share."""
import numbers


class LocalLLMError(Exception):
    """An error caused by input the user can fix; the CLI prints it as one line, no traceback."""


class Cancelled(Exception):
    """Work stopped because the caller asked it to (generate's `cancel`)."""


def is_whole(v) -> bool:
    """An integer (numpy's too), not a bool and not a float that happens to be whole."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number (numpy's too, integers included), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
