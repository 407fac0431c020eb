"""The engine as the evaluation sees it: the public `ddctl` command line, run as a subprocess.

Nothing here reaches into the engine's internals: token counts come from `ddctl tokenize`,
the context length from `ddctl info`, answers and transfer figures from `ddctl generate --json`.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class EngineSetupError(Exception):
    """The binary or the model is missing, or ddctl refused a request; the message says which."""


def default_ddctl():
    return Path(os.environ.get("DD_BUILD_DIR", REPO / "build")) / "bin" / "ddctl"


def _tail(text, n=600):
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


class Ddctl:
    """One ddctl binary and one model. Methods raise EngineSetupError with ddctl's own message."""

    def __init__(self, exe=None, model=None):
        self.exe = Path(exe) if exe else default_ddctl()
        self.model = models.model_path(model)
        if not (self.exe.is_file() and os.access(self.exe, os.X_OK)):
            raise EngineSetupError(f"ddctl binary not found at {self.exe}: run scripts/build (or pass --ddctl PATH)")
        if not self.model.exists():
            raise EngineSetupError(f"model not found at {self.model}: run scripts/fetch-model (or pass --model PATH)")
        self._info = None

    def _run(self, args, timeout):
        cmd = [str(self.exe), *args, "--model", str(self.model)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise EngineSetupError(f"ddctl {args[0]} did not finish within {timeout} s") from e
        if r.returncode != 0:
            raise EngineSetupError(f"ddctl {args[0]} failed (exit {r.returncode}): {_tail(r.stderr)}")
        return r.stdout

    def info(self):
        """The model's configuration as `ddctl info` prints it (JSON)."""
        if self._info is None:
            self._info = json.loads(self._run(["info"], timeout=120))
        return self._info

    def context_length(self):
        return int(self.info()["context_length"])

    def count_tokens(self, text):
        """Prompt tokens exactly as `ddctl generate` will see them (BOS included)."""
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            out = self._run(["tokenize", "--prompt_file", f.name], timeout=300).strip()
        return len(out.split(",")) if out else 0

    def generate(self, prompt, mode, budget, max_new_tokens, stop="\n", timeout=1800, extra=()):
        """Runs one greedy generation; returns ddctl's JSON summary as a dict. `extra` are more
        ddctl flags (e.g. --ignore_eos, --predictor)."""
        args = ["generate", "--json", "--mode", mode, "--max_new_tokens", str(max_new_tokens), *extra]
        if mode != "full":
            args += ["--budget", str(budget)]
        if stop:
            args += ["--stop", stop]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write(prompt)
            f.flush()
            out = self._run(args + ["--prompt_file", f.name], timeout=timeout)
        try:
            return json.loads(out)
        except json.JSONDecodeError as e:
            raise EngineSetupError(f"ddctl generate printed something that is not JSON: {_tail(out)}") from e
