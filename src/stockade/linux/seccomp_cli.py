"""`stockade profiles`: list the seccomp profiles, or check a profile file."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profiles",
        help="list the seccomp profiles (--seccomp NAME|PATH)",
        description="List the built-in seccomp profiles with a one-line description, "
        "or compile and check a profile (a name or a path to an OCI-style JSON file).",
    )
    p.add_argument(
        "--check", metavar="NAME|PATH", help="compile and validate a profile, print its digest"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_profiles)


def _profiles(args: argparse.Namespace) -> int:
    from . import seccomp

    if args.check:
        f = seccomp.compile_profile(args.check)
        if args.json:
            print(json.dumps({"name": f.name, "digest": f.digest, "instructions": f.instructions}))
        else:
            print(f"{f.name}: ok, {f.instructions} BPF instructions, sha256 {f.digest}")
        return 0
    infos = seccomp.list_profiles()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": i.name,
                        "path": str(i.path),
                        "description": i.description,
                        "defaultAction": i.default_action,
                    }
                    for i in infos
                ],
                indent=1,
            )
        )
        return 0
    width = max(len(i.name) for i in infos)
    for i in infos:
        print(f"{i.name:<{width}}  {i.description}")
    print(f"{'off':<{width}}  no seccomp filter (needs --allow-degraded seccomp)")
    return 0
