"""The profiles shipped with stockade (``seccomp_profiles/``), a profile named by
name or path, and the list ``stockade profiles`` prints."""

from __future__ import annotations

import errno as _errno
import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import PolicyError

BUILTIN_PROFILES = ("default", "strict", "permissive")


@dataclass(frozen=True)
class ProfileInfo:
    name: str
    path: Path
    description: str
    default_action: str


def _profiles_dir() -> Path:
    return Path(__file__).resolve().parent.parent.parent / "seccomp_profiles"


def profile_path(spec: str) -> tuple[str, Path]:
    """(display name, path) for a profile name or a path to a JSON file."""
    if spec == "off":
        raise PolicyError("--seccomp off is not a profile: it needs --allow-degraded seccomp")
    if "/" in spec or spec.endswith(".json"):
        p = Path(spec).expanduser()
        if p.is_dir():
            raise PolicyError(f"seccomp profile {spec}: is a directory; expected a JSON profile file (or one of {', '.join(BUILTIN_PROFILES)})")
        if not p.is_file():
            what = "no such file" if not p.exists() else "not a regular file"
            raise PolicyError(f"seccomp profile {spec}: {what}; expected a JSON profile file (or one of {', '.join(BUILTIN_PROFILES)})")
        return str(p), p.resolve()
    if spec not in BUILTIN_PROFILES:
        raise PolicyError(
            f"unknown seccomp profile {spec!r}: use one of {', '.join(BUILTIN_PROFILES)}, "
            "'off', or a path to a JSON profile"
        )
    return spec, _profiles_dir() / f"{spec}.json"


def list_profiles() -> list[ProfileInfo]:
    out: list[ProfileInfo] = []
    for name in BUILTIN_PROFILES:
        p = _profiles_dir() / f"{name}.json"
        try:
            doc = json.loads(p.read_bytes())
            desc = str(doc.get("description", ""))
            dflt = str(doc.get("defaultAction", ""))
            if dflt == "SCMP_ACT_ERRNO" and doc.get("defaultErrnoRet") is not None:
                eno = doc["defaultErrnoRet"]
                dflt += f"({_errno.errorcode.get(eno, eno) if isinstance(eno, int) else eno})"
        except (OSError, ValueError, AttributeError) as exc:
            desc, dflt = f"unreadable: {exc}", "?"
        out.append(ProfileInfo(name=name, path=p, description=desc, default_action=dflt))
    return out
