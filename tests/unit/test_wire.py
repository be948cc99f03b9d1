"""The launcher's wire format (csrc/wire.c): a plan part, kept per distinct plan, and a
run part (command, environment, cwd, the overlay's layers, fd slots) packed per run,
both by C. Python never writes or edits the packed bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stockade import plan as P
from stockade.launch import launcher, lower


def req(tmp_path: Path, **kw: object) -> P.Request:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    base: dict[str, object] = dict(
        argv=("make",), project=proj, cwd=proj, env={"PATH": "/usr/bin"},
        upper=tmp_path / "s1" / "upper", work=tmp_path / "s1" / "work",
    )
    base.update(kw)
    return P.Request(**base)  # type: ignore[arg-type]


def run_variants(tmp_path: Path) -> list[P.Request]:
    """Requests whose plans differ only in what a run part carries."""
    s2 = tmp_path / "s2"
    (tmp_path / "proj" / "sub").mkdir(parents=True, exist_ok=True)
    return [
        req(tmp_path),
        req(tmp_path, argv=("sh", "-c", "echo hi")),
        req(tmp_path, upper=s2 / "upper", work=s2 / "work"),
        req(tmp_path, upper=s2 / "upper", work=s2 / "work", lower_layers=(s2 / "layers/001-a",)),
        req(tmp_path, env={"PATH": "/bin:/usr/bin", "X": "1"}),
        req(tmp_path, cwd=tmp_path / "proj" / "sub"),
    ]


@pytest.fixture(autouse=True)
def _clean() -> None:
    launcher._by_id.clear()
    launcher._by_value.clear()


def part(plan: P.Plan) -> bytes:
    parts = launcher.split(plan)
    assert parts is not None
    return lower.LoweredPlan(plan, parts[1]).pack()


def run_part(plan: P.Plan) -> bytes:
    got = launcher.packed(plan)
    assert got is not None
    mounts = tuple(plan.mounts[i] for i in got.run_idx)
    return lower.LoweredRun(plan, mounts, (3, 4, 5), -1, join_fds=(6, 7), hold_fd=8).pack()


def test_plans_that_differ_in_run_fields_share_one_plan_part(tmp_path: Path) -> None:
    """Another command, session (overlay layers), environment or cwd: the same plan part,
    made once (the value cache), equal to lowering and packing that plan afresh; the
    run part is what differs, and carries that plan's own overlay layers."""
    plans = [P.build(r) for r in run_variants(tmp_path)]
    first = launcher.packed(plans[0])
    assert first is not None
    runs = set()
    for plan in plans:
        got = launcher.packed(plan)
        assert got is not None and got.plan is plan
        assert got.packed is first.packed  # made once
        assert part(plan) == first.packed  # and what this plan would give afresh
        assert lower.plan_key(plan, plan.mounts) == lower.plan_key(plans[0], plans[0].mounts)
        r = run_part(plan)
        runs.add(r)
        overlay = next(m for m in plan.mounts if m.kind == "overlay")
        assert lower.overlay_options(overlay).encode() in r  # this plan's layers, in its run part
        assert plan.argv[-1].encode() in r
    assert len(runs) == len(plans)


def test_plans_that_differ_elsewhere_get_their_own_plan_part(tmp_path: Path) -> None:
    a = P.build(req(tmp_path))
    for other in (req(tmp_path, network="host"), req(tmp_path, read_only=True, upper=None, work=None),
                  req(tmp_path, rlimits=((7, 64, 64),)), req(tmp_path, hostname="other")):
        b = P.build(other)
        assert lower.plan_key(a, a.mounts) != lower.plan_key(b, b.mounts), other
        got_a, got_b = launcher.packed(a), launcher.packed(b)
        assert got_a is not None and got_b is not None
        assert got_b.packed == part(b) != got_a.packed


# Every Plan field is lowered into the plan part (and so in plan_key), into the run part,
# or not lowered at all. A new field must be put in one of these, or this test fails.
RUN_FIELDS = {"argv", "env", "cwd"}  # and the overlay ops' layers (in "mounts")
PLAN_FIELDS = {"mounts", "namespaces", "uid_map", "gid_map", "deny_setgroups", "drop_groups", "uid", "gid",
               "hostname", "rlimits", "keep_fds", "keep_caps", "landlock", "seccomp_bpf"}
NOT_LOWERED = {"project", "user_name", "home", "seccomp_name", "network", "forward", "read_only", "hidden", "degraded",
               "notes", "env_warnings",
               "writable_tmpfs", "tmpfs_size"}  # (the disk watchdog's; the caps are in the mounts' data)


def test_every_plan_field_is_placed() -> None:
    names = {f.name for f in dataclasses.fields(P.Plan)}
    assert names == RUN_FIELDS | PLAN_FIELDS | NOT_LOWERED, names ^ (RUN_FIELDS | PLAN_FIELDS | NOT_LOWERED)


def test_plan_key_follows_every_plan_part_field(tmp_path: Path) -> None:
    """Changing any field the plan part is made from changes the key (a stale plan part
    would be a run with another run's walls)."""
    plan = P.build(req(tmp_path))
    assert plan.landlock is not None
    changed = {
        "namespaces": plan.namespaces[:-1],
        "uid_map": P.IdMap(((0, 1, 1),)),
        "gid_map": P.IdMap(((0, 1, 1),)),
        "deny_setgroups": not plan.deny_setgroups,
        "drop_groups": not plan.drop_groups,
        "uid": plan.uid + 1,
        "gid": plan.gid + 1,
        "hostname": plan.hostname + "x",
        "rlimits": ((7, 1, 1),),
        "keep_fds": (9,),
        "keep_caps": ("CAP_CHOWN",),
        "landlock": dataclasses.replace(plan.landlock, rules=plan.landlock.rules[1:]),
        "seccomp_bpf": plan.seccomp_bpf + b"\0" * 8,
        "mounts": plan.mounts[:-1],
    }
    assert set(changed) == PLAN_FIELDS
    base = lower.plan_key(plan, plan.mounts)
    for name, value in changed.items():
        other = dataclasses.replace(plan, **{name: value})
        assert lower.plan_key(other, other.mounts) != base, name
    # an overlay op's other attributes are the plan part's too
    i = next(i for i, m in enumerate(plan.mounts) if m.kind == "overlay")
    ro = plan.mounts[i]
    for m in (dataclasses.replace(ro, flags=ro.flags | {"ro"}), dataclasses.replace(ro, target=ro.target + "x")):
        other = dataclasses.replace(plan, mounts=(*plan.mounts[:i], m, *plan.mounts[i + 1:]))
        assert lower.plan_key(other, other.mounts) != base


def test_run_apply_refuses_an_overlay_index_of_another_op(tmp_path: Path) -> None:
    """sk_run_apply (the launcher's and a cold start's one way to fill in a run) checks
    that each overlay it carries names an overlay op."""
    plan = P.build(req(tmp_path))
    low = lower.LoweredPlan(plan, plan.mounts)
    i = next(i for i, m in enumerate(plan.mounts) if m.kind == "overlay")
    shifted = (*plan.mounts[:i], plan.mounts[0], *plan.mounts[i:])  # the overlay one index later
    with pytest.raises(ValueError, match="overlay"):
        lower.LoweredRun(plan, shifted, (-1, -1, -1), -1).apply(low)
