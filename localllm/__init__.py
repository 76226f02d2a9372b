"""localllm: low-bit LLM inference with QDEC dynamic error compensation."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

try:  # (torch's import takes seconds)
    from .errors import LocalLLMError
    from .generate import Stats, Stream, generate
    from .runtime import LocalModel, load
except KeyboardInterrupt:  # Ctrl+C while the `localllm` command starts: its usual line, not an import traceback
    if _sys.argv and _os.path.basename(_sys.argv[0]) == "localllm":
        print("\nlocalllm: interrupted", file=_sys.stderr)
        raise SystemExit(130) from None
    raise

__all__ = ["LocalLLMError", "LocalModel", "Stats", "Stream", "generate", "load", "__version__"]
