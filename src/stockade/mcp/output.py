"""A command's stdout and stderr for a tool result: each kept in an unnamed temporary
file while the command runs (never in memory, whatever it prints), then cut to the
size cap with a note saying what was left out and where the whole stream is."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Stream:
    """One stream as the agent sees it: ``text`` (UTF-8, bad bytes replaced), the bytes
    the command wrote, and how many of them ``text`` leaves out."""

    text: str
    size: int
    omitted: int

    def to_json(self) -> dict[str, object]:
        return {"text": self.text, "bytes": self.size, "omitted_bytes": self.omitted}


class Sink:
    """An unnamed temporary file a command's stream is written to (``fd`` for RunIO)."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="stockade-mcp-")  # noqa: SIM115 - closed by close()

    @property
    def fd(self) -> int:
        return self.file.fileno()

    def read(self, cap: int, name: str, where: str) -> Stream:
        """The stream, its head and tail when it is over ``cap`` bytes (the end of a
        build's output is where its error is), with a note in the middle."""
        size = os.fstat(self.fd).st_size
        if size <= cap:
            return Stream(_decode(os.pread(self.fd, size, 0)), size, 0)
        head = cap // 2
        tail = cap - head
        omitted = size - head - tail
        note = (f"\n[... {omitted} bytes of {name} left out: each stream of a result is cut to {cap} bytes "
                f"(`stockade mcp --max-output`, [mcp] max_output); {where} ...]\n")
        text = _decode(os.pread(self.fd, head, 0)) + note + _decode(os.pread(self.fd, tail, size - tail))
        return Stream(text, size, omitted)

    def close(self) -> None:
        self.file.close()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def cut(text: str, cap: int, what: str, remedy: str) -> tuple[str, int]:
    """A tool's own long text (a diff) cut to ``cap`` bytes, with a note: (text, bytes left out)."""
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= cap:
        return text, 0
    kept = raw[:cap].decode("utf-8", "ignore")
    omitted = len(raw) - len(kept.encode("utf-8", "surrogateescape"))
    return kept + f"\n[... {omitted} more bytes of {what} left out (cap {cap} bytes); {remedy}]\n", omitted
