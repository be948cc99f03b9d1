"""Token formats recognised in values: the environment filter drops variables that
hold one, the audit log redacts them. A module of its own so that the audit log
does not import the policy package."""

from __future__ import annotations

import re

# (label, regex) of token formats found in values; also used by the audit redactor.
# Compiled on first use (``patterns()``): a CLI run that redacts nothing compiles none.
SOURCES: tuple[tuple[str, str], ...] = (
    ("github-token", r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    ("github-token", r"\bgithub_pat_[A-Za-z0-9_]{22,}"),
    ("aws-access-key-id", r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b"),
    ("api-key", r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{20,}"),
    ("stripe-key", r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    ("slack-token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("gitlab-token", r"\bglpat-[A-Za-z0-9_-]{20,}"),
    ("google-api-key", r"\bAIza[0-9A-Za-z_-]{35}"),
    ("npm-token", r"\bnpm_[A-Za-z0-9]{36}"),
    ("pypi-token", r"\bpypi-AgE[A-Za-z0-9_-]{50,}"),
    ("huggingface-token", r"\bhf_[A-Za-z0-9]{30,}"),
    ("private-key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----"),
    ("jwt", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("url-password", r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@"),
)

#: Literal text that every match of some pattern above contains: a string holding
#: none of these matches no pattern (the redactor's cheap pre-check).
NEEDLES: tuple[str, ...] = (
    "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_",
    "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "ANVA", "AIPA",
    "sk-", "k_live_", "k_test_", "xox", "glpat-", "AIza", "npm_", "pypi-AgE", "hf_",
    "-----BEGIN ", "eyJ", "://",
)
#: Likewise for the HTTP headers the redactor hides (case-insensitive, after a ':').
HEADER_NEEDLES: tuple[str, ...] = ("authorization", "x-api-key", "cookie")

_compiled: tuple[tuple[str, re.Pattern[str]], ...] | None = None


def patterns() -> tuple[tuple[str, re.Pattern[str]], ...]:
    """(label, compiled regex) of every token format."""
    global _compiled
    if _compiled is None:
        _compiled = tuple((label, re.compile(src)) for label, src in SOURCES)
    return _compiled


def may_hold_secret(s: str) -> bool:
    """False when no token pattern (nor a secret header) can match ``s``."""
    for n in NEEDLES:
        if n in s:
            return True
    if ":" in s:
        low = s.lower()
        return any(n in low for n in HEADER_NEEDLES)
    return False
