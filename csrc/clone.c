/* clone.c: clone3 with its clone(2) fallback, and entering the run's cgroups from
 * the child (cgroup v1 tasks files; cgroup.procs when CLONE_INTO_CGROUP is missing).
 * Used by a cold start (spawn.c, child.c) and by a launcher's run child. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

/* Write "0" (this task) to each of the run's v1 `tasks` files. Moving another
 * process (cgroup.procs, or any pid) takes the threadgroup lock, whose writer
 * waits for an RCU grace period (5-15 ms) unless one just passed; a
 * single-threaded task moving itself does not. Before anything of the run's:
 * everything the command does is accounted and limited. */
void sk_cgroup_join(const struct sk_plan *p, int rep)
{
    for (size_t i = 0; i < p->n_cgroup_join_fds; i++) {
        int fd = p->cgroup_join_fds[i];
        ssize_t n;
        do
            n = write(fd, "0", 1);
        while (n < 0 && errno == EINTR);
        if (n != 1) {
            sk_report(rep, SK_REP_ERROR, SK_STEP_CGROUP_JOIN, n < 0 ? errno : EIO, (int)i, NULL);
            _exit(125);
        }
        close(fd);
    }
}

long sk_clone(struct sk_clone_args *ca, int *procs_fd)
{
    *procs_fd = -1;
    long pid = syscall(SYS_clone3, ca, sizeof *ca);
    if (pid >= 0 || errno != ENOSYS)
        return pid;
    unsigned long long flags = ca->flags;
    if (flags & CLONE_INTO_CGROUP) {
        /* Open-time credentials decide a cgroup move: the parent's, as with
         * CLONE_INTO_CGROUP. The child writes "0" (itself): a task moving itself
         * skips the RCU wait that moving another one costs. */
        int fd = openat((int)ca->cgroup, "cgroup.procs", O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            return -1;
        *procs_fd = fd;
        flags &= ~(CLONE_INTO_CGROUP | (unsigned long long)CLONE_NEWCGROUP);
    }
    if (flags >> 32) { /* no other clone3-only flag has a clone(2) form */
        if (*procs_fd >= 0)
            close(*procs_fd);
        *procs_fd = -1;
        errno = ENOSYS;
        return -1;
    }
    /* x86_64 and arm64 agree on (flags, stack, parent_tid, ...): with
     * CLONE_PIDFD, the pidfd is stored at parent_tid. A NULL stack: fork-like. */
    pid = syscall(SYS_clone, (unsigned long)flags | (unsigned long)(ca->exit_signal & 0xff), NULL,
                  (int *)(uintptr_t)ca->pidfd, NULL, 0UL);
    if (pid < 0 && *procs_fd >= 0) {
        int e = errno;
        close(*procs_fd);
        *procs_fd = -1;
        errno = e;
    }
    return pid;
}

void sk_join_procs(int procs_fd, int rep)
{
    ssize_t n;
    do
        n = write(procs_fd, "0", 1);
    while (n < 0 && errno == EINTR);
    if (n != 1) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CGROUP_JOIN, n < 0 ? errno : EIO, -1, "cgroup.procs");
        _exit(125);
    }
    close(procs_fd);
}
