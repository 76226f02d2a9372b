"""localllm: low-bit LLM inference with QDEC dynamic error compensation."""
__version__ = "0.1.0"

from .errors import LocalLLMError  # noqa: E402
from .generate import generate  # noqa: E402
from .runtime import LocalModel, load  # noqa: E402

__all__ = ["LocalLLMError", "LocalModel", "generate", "load", "__version__"]
