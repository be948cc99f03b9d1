"""`stockade mcp`'s tools: their input schemas take nothing that widens the sandbox,
refuse every undeclared key, and a bad call is one line naming the argument."""

from __future__ import annotations

import pytest

from stockade.errors import UsageError
from stockade.mcp import output, tools


def test_every_schema_is_closed_and_described() -> None:
    assert [t.name for t in tools.TOOLS] == ["exec", "run", "start", "stop", "status", "diff", "snapshot",
                                           "restore", "discard", "apply"]
    for t in tools.TOOLS:
        s = tools.schema(t)
        assert s["type"] == "object" and s["additionalProperties"] is False, t.name
        for name, prop in s["properties"].items():
            assert prop.get("description"), (t.name, name)
        assert "$defs" not in s, t.name  # flat: clients without $ref support read it


@pytest.mark.parametrize("key", ["network", "net", "allow", "mounts", "memory", "limits", "root", "seccomp",
                                 "project", "session", "grants", "env_allow", "pass_fds", "shell"])
def test_an_undeclared_key_is_refused_with_the_reason(key: str) -> None:
    with pytest.raises(UsageError) as e:
        tools.parse(tools.BY_NAME["exec"], {"command": "true", key: "x"})
    msg = e.value.one_line()
    assert msg.startswith(f"exec: unknown argument {key!r}") and "never by a tool call" in msg and "\n" not in msg


@pytest.mark.parametrize(("args", "want"), [
    ({}, "'command' is required"),
    ({"command": ""}, "'command'"),
    ({"command": 5}, "'command'"),
    ({"command": "x", "timeout": "5"}, "'timeout'"),
    ({"command": "x", "timeout": 0}, "'timeout'"),
    ({"command": "x", "timeout": 1e9}, "'timeout'"),
    ({"command": "x", "env": {"A": 1}}, "'env.A'"),
    ({"command": "x", "cwd": ["src"]}, "'cwd'"),
])
def test_bad_values(args: dict[str, object], want: str) -> None:
    with pytest.raises(UsageError) as e:
        tools.parse(tools.BY_NAME["run"], args)
    assert want in e.value.one_line() and e.value.one_line().startswith("run: ")


def test_good_values() -> None:
    a = tools.parse(tools.BY_NAME["exec"], {"command": "make", "cwd": "src", "env": {"A": "1"}, "timeout": 5,
                                            "stdin": "x"})
    assert isinstance(a, tools.CommandArgs) and (a.timeout, a.env) == (5.0, {"A": "1"})
    d = tools.parse(tools.BY_NAME["diff"], None)
    assert isinstance(d, tools.DiffArgs) and (d.paths, d.stat) == ([], False)
    with pytest.raises(UsageError, match="status takes no arguments"):
        tools.parse(tools.BY_NAME["status"], {"verbose": True})


def test_output_is_cut_head_and_tail() -> None:
    sink = output.Sink()
    try:
        os_write = b"".join(b"%d\n" % i for i in range(10000))
        import os

        os.write(sink.fd, os_write)
        s = sink.read(1000, "stdout", "see the log")
        assert s.size == len(os_write) and s.omitted == len(os_write) - 1000
        assert s.text.startswith("0\n1\n") and s.text.endswith("9998\n9999\n")
        assert f"[... {s.omitted} bytes of stdout left out" in s.text and "see the log" in s.text
        small = sink.read(len(os_write), "stdout", "")
        assert small.omitted == 0 and small.text == os_write.decode()
    finally:
        sink.close()
    text, omitted = output.cut("é" * 100, 51, "the diff", "ask for less")
    assert omitted == 150 and text.startswith("é" * 25 + "\n[... 150 more bytes")
