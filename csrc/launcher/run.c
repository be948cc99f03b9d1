/* run.c: one run. C1 (forked for it, or the spare) is in the run's namespaces:
 * it clones the sandbox's init (C2, child.c's sk_run_child), reports init's pidfd
 * and its end, and unmounts the run's overlay. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launcher.h"

/* Move fd above floor (close-on-exec), closing the original. */
static int lift(int fd, int floor)
{
    if (fd < 0 || fd > floor)
        return fd;
    int n = fcntl(fd, F_DUPFD_CLOEXEC, floor + 1);
    close(fd);
    return n;
}

static int slot(const int *fds, int nfds, int s)
{
    return (s >= 0 && s < nfds) ? fds[s] : -1;
}


unsigned long run_ns_flags(const struct sk_plan *p)
{
    return CLONE_NEWNS | (p->clone_flags & (CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID));
}

/* Unmount the plan's overlays in our mount namespace, which init pivoted into
 * the sandbox's root (or not, if it failed before): 0, or the errno. */
static int unmount_overlays(const struct sk_plan *p)
{
    int err = 0;
    for (size_t i = 0; i < p->n_ops; i++) {
        const struct sk_mount_op *op = &p->ops[i];
        if (op->kind != SK_OP_OVERLAY || !op->target)
            continue;
        const char *t = op->target;
        const char *inside = strncmp(t, "/newroot/", 9) == 0 ? t + 8 : t;
        if (umount2(inside, 0) == 0 || umount2(t, 0) == 0)
            continue;
        if (errno != EINVAL && errno != ENOENT)
            err = errno;
    }
    return err;
}

/* C1 after its namespaces exist: clone init and report on it until it is reaped.
 * hold: the index in fds of the run's hold fd, or -1. */
void run_in_ns(struct sk_plan *p, int *fds, int nfds, int unshare_err, int hold)
{
    int rep = fds[0], sync_fd = fds[1], st = fds[2];
    int hold_fd = hold >= 0 ? fds[hold] : -1;
    if (unshare_err) {
        send_report(st, SK_REP_ERROR, SK_STEP_UNSHARE, unshare_err, 0, NULL, -1);
        _exit(1);
    }

    /* Slots -> our fd numbers. */
    for (int i = 0; i < 3; i++)
        p->stdio[i] = slot(fds, nfds, p->stdio[i]);
    p->console_sock = slot(fds, nfds, p->console_sock);
    p->serve_fd = slot(fds, nfds, p->serve_fd);
    p->observe_sock = slot(fds, nfds, p->observe_sock);
    int cgfd = slot(fds, nfds, p->cgroup_fd);
    p->cgroup_fd = -1;
    int *join = (int *)p->cgroup_join_fds;
    for (size_t i = 0; i < p->n_cgroup_join_fds; i++)
        join[i] = slot(fds, nfds, join[i]);
    size_t nk = p->n_keep_fds;
    int keep_src[256];
    int floor = 2;
    for (size_t i = 0; i < nk; i++) {
        keep_src[i] = (int)(nfds - (int)nk + (int)i) >= 3 ? fds[nfds - (int)nk + (int)i] : -1;
        if (p->keep_fds[i] > floor)
            floor = p->keep_fds[i];
    }

    struct sk_clone_args ca;
    int pidfd = -1;
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_PIDFD;
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    if (cgfd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgfd;
    }
    int procs_fd;
    long pid = sk_clone(&ca, &procs_fd);
    if (pid == 0) {
        /* C2: the sandbox's init. */
        prctl(PR_SET_NAME, "stockade-init", 0, 0, 0);
        close(st);
        if (cgfd >= 0)
            close(cgfd);
        if (procs_fd >= 0)
            sk_join_procs(procs_fd, rep); /* clone(2) fallback: no CLONE_INTO_CGROUP */
        sk_cgroup_join(p, rep); /* then the cgroup namespace is rooted at them */
        if ((p->clone_flags & CLONE_NEWCGROUP) && unshare(CLONE_NEWCGROUP) < 0) {
            sk_report(rep, SK_REP_ERROR, SK_STEP_UNSHARE, errno, 0, "cgroup");
            _exit(125);
        }
        /* Everything we hold goes above the highest number a passed fd wants,
         * then each passed fd moves to its number. */
        rep = lift(rep, floor);
        sync_fd = lift(sync_fd, floor);
        sk_overlay_hold_fd = lift(hold_fd, floor);
        for (int i = 0; i < 3; i++)
            p->stdio[i] = lift(p->stdio[i], floor);
        p->console_sock = lift(p->console_sock, floor);
        p->serve_fd = lift(p->serve_fd, floor);
        p->observe_sock = lift(p->observe_sock, floor);
        for (size_t i = 0; i < nk; i++)
            keep_src[i] = lift(keep_src[i], floor);
        for (size_t i = 0; i < nk; i++) {
            if (keep_src[i] < 0 || dup2(keep_src[i], p->keep_fds[i]) < 0) {
                sk_report(rep, SK_REP_ERROR, SK_STEP_CLOSE_FDS, keep_src[i] < 0 ? EBADF : errno,
                          p->keep_fds[i], "pass-fd");
                _exit(125);
            }
        }
        sk_run_child(p, sync_fd, rep);
    }
    int e = errno;
    if (procs_fd >= 0)
        close(procs_fd);
    /* C1 keeps only the status socket (the pipes must see EOF when init is done)
     * and the hold. */
    for (int i = 0; i < nfds; i++)
        if (fds[i] != st && fds[i] != hold_fd)
            close(fds[i]);
    if (pid < 0) {
        send_report(st, SK_REP_ERROR, SK_STEP_CLONE, e, 0, NULL, -1);
        _exit(1);
    }
    /* With init's pidfd goes ours, for the case where the session's overlay can
     * only go with our mount namespace (see unmount_overlays below). */
    int self_fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    send_report2(st, SK_REP_INIT, 0, 0, (int)pid, NULL, pidfd, self_fd);
    if (self_fd >= 0)
        close(self_fd);
    /* Whoever asked for this run may vanish (killed): then so does the run. */
    struct pollfd pf[2] = {{.fd = pidfd, .events = POLLIN}, {.fd = st, .events = POLLRDHUP}};
    for (;;) {
        int r = poll(pf, 2, -1);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pf[0].revents)
            break; /* init is gone */
        if (pf[1].revents & (POLLHUP | POLLRDHUP | POLLERR)) {
            syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
            pf[1].fd = -1;
        }
    }
    close(pidfd);
    int status = 0;
    while (waitpid((pid_t)pid, &status, __WALL) < 0) {
        if (errno != EINTR) {
            status = SIGKILL; /* cannot happen: it is our child */
            break;
        }
    }
    /* The overlay on the session's upper layer must be gone before the session's
     * next run mounts it: nothing of the sandbox is left to hold it, so unmount it
     * and leave the rest of the namespace to our exit.
     * With a hold, report first (the unmount syncs the upper's filesystem, a disk
     * cache flush the requester need not wait for) and drop the hold once the
     * overlay is gone: unmounted, or if that fails, our mount namespace left
     * behind (we are its last member: leaving it ends it, and its mounts with it).
     * Without one, unmount first; the requester waits for our exit only when that
     * fails (err != 0). */
    if (hold_fd >= 0) {
        send_report(st, SK_REP_INIT_EXIT, 0, 0, status, NULL, -1);
        kill(L.self_pid, SIGUSR1); /* time for the launcher's next spare */
        if (unmount_overlays(p) != 0 && (L.own_mntns < 0 || setns(L.own_mntns, CLONE_NEWNS) < 0))
            _exit(0); /* the hold then ends with the namespace (in exit), the best left */
        close(hold_fd);
        _exit(0);
    }
    int err = unmount_overlays(p);
    send_report(st, SK_REP_INIT_EXIT, 0, err, status, NULL, -1);
    _exit(0);
}

void c1_start(void)
{
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != L.self_pid)
        _exit(1);
    prctl(PR_SET_NAME, "stockade-run", 0, 0, 0);
    /* Every signal blocked again, as after a cold clone: init takes the ones it
     * forwards with sigwaitinfo (an unblocked SIGTERM from the requester would
     * end init at once instead of reaching the command). */
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    close_launcher_fds();
    signal(SIGCHLD, SIG_DFL);
}

/* C1 forked for one request. */
void run_child(struct sk_plan *p, int *fds, int nfds, int hold)
{
    c1_start();
    int e = unshare((int)run_ns_flags(p)) < 0 ? errno : 0;
    run_in_ns(p, fds, nfds, e, hold);
}
