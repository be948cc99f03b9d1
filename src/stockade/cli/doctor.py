"""`stockade doctor`: prints what ``stockade.doctor`` probes (the probing lives there)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .table import Args


def cmd_doctor(args: Args) -> int:
    from .. import doctor

    if args.apparmor:
        print(doctor.apparmor_profile(), end="")
        return 0
    report = doctor.run(refresh=args.refresh, self_test=args.self_test)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.format())
    return report.exit_status
