"""A real dd-kv-pool for the evaluation scripts: runs of one context in different modes,
budgets or predictors share its prefix keys, so only the first prefills the context and the
others restore it (`--prefix_block`, the same bits as prefilling: prefix_reuse_test)."""
import ctypes
import json
import signal
import subprocess
from pathlib import Path

import engine_cli

POOL_TOKEN = "eval-pool-token-0123456789abcdef"
PREFIX_BLOCK = 256
POOL_QUOTA = "12GiB"   # reserved, not touched: the pool reserves every layer's blocks (Gemma: 18, 3 written)


def _die_with_parent():
    """In the child before exec: SIGKILL when the parent dies (PR_SET_PDEATHSIG), so a script
    that exits early or is killed does not leave a pool behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Pool:
    """One dd-kv-pool process with one tenant (POOL_TOKEN); close() stops it."""

    def __init__(self, bin_dir, tmp):
        cfg = Path(tmp) / "tenants.json"
        cfg.write_text(json.dumps([{"name": "eval", "token": POOL_TOKEN, "quota": POOL_QUOTA}]))
        cfg.chmod(0o600)  # it holds the tokens: the pool refuses it readable by others
        self.log = Path(tmp) / "pool.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([str(Path(bin_dir) / "dd-kv-pool"), f"--tenants={cfg}"],
                                         stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.close()
            raise engine_cli.EngineSetupError(f"dd-kv-pool did not start: {line!r} {self.log.read_text()[-500:]}")
        self.addr = line.split()[3]

    def close(self):
        self.proc.kill()
        self.proc.wait()

    def flags(self):
        """ddctl flags that put a sparse run's KV in this pool with prefix reuse (the token
        goes in $DD_KV_POOL_TOKEN)."""
        return ["--kv_store", f"shm://{self.addr}", "--prefix_block", str(PREFIX_BLOCK)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
