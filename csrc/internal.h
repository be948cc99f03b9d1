/* Shared by the C sources; not part of the cffi API. */
#ifndef SK_INTERNAL_H
#define SK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include "stockade_native.h"

/* clone3(2), for headers that predate it (clone.c, spawn.c, launcher/run.c). */
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
struct sk_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};
/* clone3, or clone(2) when clone3 fails with ENOSYS (older Docker/podman seccomp
 * profiles refuse it that way so that glibc falls back to clone). Without
 * CLONE_INTO_CGROUP then: *procs_fd is the cgroup's cgroup.procs, opened by the
 * parent, and the child must call sk_join_procs() before anything of the run's;
 * CLONE_NEWCGROUP is then dropped from the flags and the child unshares it after
 * joining. *procs_fd is -1 otherwise. Returns the pid (0 in the child) or -1. */
long sk_clone(struct sk_clone_args *ca, int *procs_fd);
/* The child's half of the fallback: write itself to procs_fd; exits on failure. */
void sk_join_procs(int procs_fd, int rep);

/* report.c: the child's records (the one unit every other calls; it calls none). */
void sk_report(int fd, int kind, int step, int err, int value, const char *path);
void sk_report_fill(struct sk_report *r, int kind, int step, int err, int value, const char *path);
ssize_t sk_send_fd(int sock, int fd, char tag);
ssize_t sk_send_fd_flags(int sock, int fd, char tag, int flags);
size_t sk_strlen(const char *s);

/* Child side: every function here is async-signal-safe (no malloc, no stdio). */
int sk_mounts_child(const struct sk_plan *p, int rep);
int sk_landlock_child(const struct sk_landlock *ll, int rep);
int sk_seccomp_child(const unsigned char *bpf, size_t len, int rep);
/* observe.c: observe mode's filter on init and its listener's handoff (plan->observe_sock). */
int sk_observe_child(const struct sk_plan *p, int rep);
int sk_caps_child(unsigned long long keep, int rep);
void sk_init_child(const struct sk_plan *p, int rep) __attribute__((noreturn));
/* A pty of the sandbox's devpts: its master goes over sock (runc's console socket),
 * its peer is returned; a failure is reported on rep and ends the process. */
int sk_console_pty(int sock, int rep);

/* mounts.c: the staging tree, the op loop, and the final pivot, as steps.
 * sk_overlay_hold_fd (a launcher's run child; else -1): the session's overlay
 * lock, taken (flock LOCK_EX) before an overlay is mounted: it is free once no
 * overlay of an earlier run on the same upper layer is left. */
extern int sk_overlay_hold_fd;
int sk_mounts_stage(const struct sk_plan *p, int rep);
int sk_mounts_ops(const struct sk_plan *p, int rep, int *detached);
int sk_mounts_finish(int rep, int detached);

/* child.c: the ordered steps. A cold start's child (spawn.c clones it; procs_fd:
 * see sk_clone), and a launcher's run child (already in its own namespaces). */
void sk_child_main(const struct sk_plan *p, int sync_fd, int rep, int procs_fd) __attribute__((noreturn));
void sk_run_child(const struct sk_plan *p, int sync_fd, int rep) __attribute__((noreturn));
/* clone.c: cgroup v1: enter the run's cgroups (plan->cgroup_join_fds); exits on failure. */
void sk_cgroup_join(const struct sk_plan *p, int rep);

/* wire.c (launcher side): a plan part and, unless run_len is 0 (a base plan), a run
 * part applied to it; *hold_fd: the run's hold slot, or -1. 0 or -EINVAL. */
int sk_wire_unpack(const unsigned char *plan, size_t plan_len, const unsigned char *run, size_t run_len,
                   struct sk_plan *p, int *hold_fd);
void sk_plan_free(struct sk_plan *p);

#endif
