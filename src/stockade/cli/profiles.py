"""`stockade profiles`: list the seccomp profiles, or check a profile file."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .table import Args


def cmd_profiles(args: Args) -> int:
    from ..linux import seccomp

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
