"""Append-only JSONL results that survive an interrupted run.

Each record is one line written with a single write() on an O_APPEND descriptor and fsync'ed,
so after a crash the file holds whole records plus at most one partial last line. Opening the
file drops that partial line (with a warning) by truncating it away, so the next append starts
on a fresh line. A record is identified by its key (task id, mode, budget); the first record
for a key wins and later duplicates are ignored with a warning.
"""
import json
import os
import sys


class ResultsFileError(Exception):
    """The results file is damaged somewhere other than its last line."""


def record_key(record):
    return (record["task_id"], record["mode"], int(record.get("budget") or 0))


class JsonlStore:
    def __init__(self, path, warn=None):
        self.path = path
        self.warn = warn or (lambda msg: print(f"[eval] warning: {msg}", file=sys.stderr))
        self.records = {}
        self._load()

    def _load(self):
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()            # the file ends with a newline, as it should
        kept_bytes = 0
        for i, raw in enumerate(lines):
            last = i == len(lines) - 1
            try:
                if last and not data.endswith(b"\n"):
                    raise ValueError("no newline after it")
                record = json.loads(raw)
                key = record_key(record)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                if not last:
                    raise ResultsFileError(
                        f"{self.path} line {i + 1} is not a result record ({e}); fix or remove that line, "
                        f"or start over with --restart") from e
                self.warn(f"{self.path}: dropping an incomplete last line ({len(raw)} bytes; {e})")
                break
            if key in self.records:
                self.warn(f"{self.path} line {i + 1}: duplicate result for {key}, keeping the first")
            else:
                self.records[key] = record
            kept_bytes += len(raw) + 1
        if kept_bytes < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(kept_bytes)

    def has(self, key):
        return key in self.records

    def append(self, record):
        key = record_key(record)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.setdefault(key, record)
