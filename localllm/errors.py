"""User-facing errors: one line that names the problem and the fix; and the test of a whole-number argument the
checks before them share."""
import numbers
import sys
from pathlib import Path


class LocalLLMError(Exception):
    """An error caused by input the user can fix; the CLI prints it as one line, no traceback."""


def script_main(main, *args):
    """Run a script's main(*args) (scripts/): a LocalLLMError ends it with one line and status 2, as the CLI's."""
    try:
        return main(*args)
    except LocalLLMError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)


class Cancelled(Exception):
    """Work stopped because the caller asked it to (generate's `cancel`)."""


def is_whole(v) -> bool:
    """An integer (numpy's too), not a bool and not a float that happens to be whole."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number (numpy's too, integers included), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
