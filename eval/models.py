"""The one place the Python side resolves a model: short names, the cache directory, the default.

Same rules as `ddctl --model` and scripts/fetch-model (which fills the cache):
    explicit argument > $DD_MODEL > "gemma";
a known short name ("gemma", "smollm2") means that file in the cache directory,
$DD_MODEL_DIR or else ~/.cache/dualdecoder/models; anything else is a path.

    python3 eval/models.py [NAME_OR_PATH]    # prints the resolved path (for shell scripts)
"""
import os
import sys
from pathlib import Path

MODELS = {
    "gemma": "gemma-3-270m-q4_k_m.gguf",
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
DEFAULT_MODEL = "gemma"


def model_dir() -> Path:
    return Path(os.environ.get("DD_MODEL_DIR") or Path.home() / ".cache" / "dualdecoder" / "models")


def model_path(name_or_path=None) -> Path:
    """The model file (or Hugging Face directory) to use; it may not exist yet."""
    choice = str(name_or_path or os.environ.get("DD_MODEL") or DEFAULT_MODEL)
    if choice in MODELS:
        return model_dir() / MODELS[choice]
    return Path(choice)


def short_name(name_or_path=None) -> str:
    """The known short name of the resolved model ("gemma", "smollm2"), else the file's stem in
    lower case: a label for results files."""
    path = model_path(name_or_path)
    for name, file in MODELS.items():
        if path.name == file:
            return name
    return path.name.split(".")[0].lower()


if __name__ == "__main__":
    print(model_path(sys.argv[1] if len(sys.argv) > 1 else None))
