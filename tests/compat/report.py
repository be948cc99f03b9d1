"""Turns STOCKADE_COMPAT_REPORT's JSON lines into a Markdown table of differences, and
prints the KNOWN_DIFFERENCES table they amount to (items from --item ID-GLOB=N rules).

  STOCKADE_COMPAT_REPORT=/tmp/r.jsonl .venv/bin/python -m pytest tests/compat
  .venv/bin/python -m tests.compat.report /tmp/r.jsonl --item '*chown*=2' ...
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--item", action="append", default=[], help="ID-GLOB=N: issue-13 item of matching ids")
    args = ap.parse_args(argv)
    rules = [(g, int(n)) for g, n in (r.rsplit("=", 1) for r in args.item)]
    with open(args.report) as f:
        rows = [json.loads(line) for line in f]
    print("| user | module | test id | bare | inside | item | inside says |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    table: dict[tuple[str, str], dict[str, int | None]] = {}
    for r in rows:
        for d in r["diffs"]:
            item = d["known"] or next((n for g, n in rules if fnmatch.fnmatchcase(d["id"], g)), None)
            why = " ".join(d["why"].strip().splitlines()[-1:])[:160].replace("|", "/")
            print(f"| {r['user']} | {r['module']} | `{d['id'].split('.', 2)[2]}` | {d['bare']} | {d['inside']} "
                  f"| {item or '?'} | {why} |")
            table.setdefault((r["user"], r["module"]), {})[d["id"]] = item
        for s in r["stale"]:
            print(f"| {r['user']} | {r['module']} | `{s}` | ok | ok | stale | remove from KNOWN_DIFFERENCES |")
    print("\nKNOWN_DIFFERENCES = {", file=sys.stderr)
    for (user, module), ids in sorted(table.items()):
        print(f'    ("{user}", "{module}"): {{', file=sys.stderr)
        for tid, item in sorted(ids.items()):
            print(f'        "{tid}": {item},', file=sys.stderr)
        print("    },", file=sys.stderr)
    print("}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
