/* stockade-launcher: a small pre-spawned process that starts sandboxes fast.
 *
 * Made once per base plan by the Python process (sk_spawn with
 * launcher_exec_fd): it lives in a new user namespace and a mount namespace
 * holding the staging tree, with the shared, read-only part of the sandbox
 * (system binds, /etc, /dev) already built at /newroot. For each run it forks
 * a child (C1) that unshares fresh mount, net, ipc, uts and pid namespaces and
 * clones the sandbox's init (C2), which finishes the tree in its own mount
 * namespace (proc, devpts, /tmp, $HOME, the project overlay, masks), detaches
 * the host, pivots and runs the same confinement steps as a cold start.
 *
 * Forking this small process costs a fraction of cloning the caller's
 * address space, and the shared part of the tree is built once.
 *
 * Protocol (SOCK_SEQPACKET control socket, one message per request):
 *   struct sk_msg_hdr, then the packed plan (wire.c) inline, or in the last
 *   fd (a memfd) with SK_MSG_PLAN_IN_FD.
 *   BASE: build the base tree; reply on the control socket with an sk_report
 *         (SK_REP_READY or SK_REP_ERROR).
 *   RUN:  fds = report pipe (write end), sync pipe (read end), status socket,
 *         then the slots the plan's fd fields index (stdio, console, cgroup,
 *         the v1 cgroups' tasks files init joins),
 *         then the fds to pass through (plan->keep_fds names their numbers).
 *         C1 answers on the status socket: SK_REP_INIT with init's pidfd, or
 *         SK_REP_ERROR; later SK_REP_INIT_EXIT with init's wait status.
 *         reserved = 1 + the slot of a *hold* fd, or 0: the session's overlay
 *         lock (a file to flock), held for as long as an overlay on the
 *         session's upper layer may exist. Init takes it just before it mounts
 *         the overlay (waiting, if need be, for the session's last run to be
 *         unmounted); C1 keeps it until the run's overlay is gone, so it can
 *         report init's status first and unmount after. Without one, C1
 *         unmounts before it reports.
 * EOF on the control socket (the Python process is gone) ends the launcher;
 * its run children die with it (death signal), and their sandboxes with them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <poll.h>
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

#include "../internal.h"

#define SK_MSG_MAGIC 0x314c4b53u /* "SKL1" */
#define SK_MSG_BASE 1
#define SK_MSG_RUN 2
#define SK_MSG_HELLO 3 /* a shared launcher's client, first: an fd of our user namespace */
#define SK_MSG_PLAN_IN_FD 1
#define MAX_FDS 250
#define INLINE_MAX (256 * 1024)
#define MAX_CLIENTS 64
#define SK_SO_PEERPIDFD 77 /* Linux 6.5 */

struct sk_msg_hdr {
    uint32_t magic, type, flags, reserved;
};

static int ctl = -1;
static pid_t self_pid;
static unsigned char msgbuf[INLINE_MAX + sizeof(struct sk_msg_hdr)];
static int listen_fd = -1;             /* shared mode: clients connect here */
static int clients[MAX_CLIENTS];
static int hello_done[MAX_CLIENTS];    /* the client proved it reaches our user namespace */
static int nclients;
static struct stat own_userns;         /* our user namespace (st_dev, st_ino) */
static long idle_ms;                   /* shared mode: exit after this long unused */
static int sigfd = -1;
static int live;                       /* forked children not yet reaped (runs, the spare) */
static pid_t spare_pid = -1;
static int spare_sock = -1;            /* to the spare run child, when there is one */
static unsigned long spare_flags;      /* the namespaces it made */
static unsigned long last_flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID;
static int own_mntns = -1;             /* our mount namespace: C1's way out of a run's */

/* A run child keeps none of the launcher's sockets. */
static void close_launcher_fds(void)
{
    if (ctl >= 0)
        close(ctl);
    if (listen_fd >= 0)
        close(listen_fd);
    for (int i = 0; i < nclients; i++)
        close(clients[i]);
    if (sigfd >= 0)
        close(sigfd);
    if (spare_sock >= 0)
        close(spare_sock);
    spare_sock = -1;
}

/* The run's hold fd slot from the request header (in msgbuf), or -1. */
static int hold_slot(int nfds)
{
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    return (h->reserved >= 4 && (int)h->reserved - 1 < nfds) ? (int)h->reserved - 1 : -1;
}

static void close_all(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* One message and its fds (all close-on-exec). 0 = EOF. */
static ssize_t recv_msg(int sock, int *fds, int *nfds)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } u;
    struct iovec iov = {.iov_base = msgbuf, .iov_len = sizeof msgbuf};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    *nfds = 0;
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0)
        return n;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k && *nfds < MAX_FDS; i++)
            memcpy(&fds[(*nfds)++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        close_all(fds, *nfds);
        *nfds = 0;
        errno = EMSGSIZE;
        return -1;
    }
    return n;
}

static void send_report2(int sock, int kind, int step, int err, int value, const char *path, int fd, int fd2);

static void send_report(int sock, int kind, int step, int err, int value, const char *path, int fd)
{
    send_report2(sock, kind, step, err, value, path, fd, -1);
}

static void send_report2(int sock, int kind, int step, int err, int value, const char *path, int fd, int fd2)
{
    struct sk_report r;
    sk_report_fill(&r, kind, step, err, value, path);
    struct iovec iov = {.iov_base = &r, .iov_len = sizeof r};
    union {
        char buf[CMSG_SPACE(2 * sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    int fds[2] = {fd, fd2};
    size_t nf = fd < 0 ? 0 : (fd2 < 0 ? 1 : 2);
    if (nf) {
        msg.msg_control = u.buf;
        msg.msg_controllen = CMSG_SPACE(nf * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nf * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nf * sizeof(int));
    }
    while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

/* The plan: inline after the header, or the whole content of a memfd. */
static int read_plan(ssize_t n, int *fds, int *nfds, struct sk_plan *p, unsigned char **heap)
{
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    *heap = NULL;
    if (n < (ssize_t)sizeof *h || h->magic != SK_MSG_MAGIC)
        return -EINVAL;
    if (!(h->flags & SK_MSG_PLAN_IN_FD))
        return sk_plan_unpack(msgbuf + sizeof *h, (size_t)n - sizeof *h, p);
    if (*nfds < 1)
        return -EINVAL;
    int mfd = fds[--*nfds];
    struct stat st;
    if (fstat(mfd, &st) < 0 || st.st_size <= 0 || st.st_size > (1 << 28)) {
        close(mfd);
        return -EINVAL;
    }
    unsigned char *b = malloc((size_t)st.st_size);
    size_t got = 0;
    while (b && got < (size_t)st.st_size) {
        ssize_t r = pread(mfd, b + got, (size_t)st.st_size - got, (off_t)got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(mfd);
    if (!b || got != (size_t)st.st_size) {
        free(b);
        return -EIO;
    }
    *heap = b;
    return sk_plan_unpack(b, got, p);
}

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


static unsigned long run_ns_flags(const struct sk_plan *p)
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
static void __attribute__((noreturn)) run_in_ns(struct sk_plan *p, int *fds, int nfds, int unshare_err, int hold)
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
        kill(self_pid, SIGUSR1); /* time for the launcher's next spare */
        if (unmount_overlays(p) != 0 && (own_mntns < 0 || setns(own_mntns, CLONE_NEWNS) < 0))
            _exit(0); /* the hold then ends with the namespace (in exit), the best left */
        close(hold_fd);
        _exit(0);
    }
    int err = unmount_overlays(p);
    send_report(st, SK_REP_INIT_EXIT, 0, err, status, NULL, -1);
    _exit(0);
}

static void c1_start(void)
{
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != self_pid)
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
static void __attribute__((noreturn)) run_child(struct sk_plan *p, int *fds, int nfds, int hold)
{
    c1_start();
    int e = unshare((int)run_ns_flags(p)) < 0 ? errno : 0;
    run_in_ns(p, fds, nfds, e, hold);
}

/* A spare C1: makes the usual namespaces now (a new network namespace alone
 * costs about half a millisecond), then waits for the request it will serve. */

static void __attribute__((noreturn)) spare_main(int sock, unsigned long flags)
{
    c1_start();
    int e = unshare((int)flags) < 0 ? errno : 0;
    int fds[MAX_FDS], nfds;
    ssize_t n;
    do
        n = recv_msg(sock, fds, &nfds);
    while (n < 0 && errno == EINTR);
    if (n <= 0)
        _exit(0);
    close(sock);
    struct sk_plan p;
    unsigned char *heap;
    int hold = hold_slot(nfds);
    if (read_plan(n, fds, &nfds, &p, &heap) < 0 || nfds < 3)
        _exit(1);
    run_in_ns(&p, fds, nfds, e, hold);
}

static void make_spare(unsigned long flags)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
        return;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        spare_main(sv[1], flags);
    }
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        return;
    }
    spare_sock = sv[0];
    spare_flags = flags;
    spare_pid = pid;
    live++;
}

/* Hand the request, as received, to the spare. 0 when it took it. */
static int to_spare(ssize_t n, const int *fds, int nfds)
{
    struct iovec iov = {.iov_base = msgbuf, .iov_len = (size_t)n};
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    int sock = spare_sock;
    spare_sock = -1;
    ssize_t r;
    do
        r = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    close(sock);
    return r == n ? 0 : -1;
}


static void reap_children(void)
{
    struct signalfd_siginfo si;
    int run_ended = 0;
    while (read(sigfd, &si, sizeof si) > 0)
        if (si.ssi_signo == SIGUSR1)
            run_ended = 1; /* a run child's init ended (see run_in_ns) */
    pid_t w;
    while ((w = waitpid(-1, NULL, WNOHANG)) > 0) {
        live--;
        if (w == spare_pid)
            spare_pid = -1;
        else
            run_ended = 1;
    }
    /* The next run's namespaces are made when a run has ended, not while one
     * starts: on a small machine that work would compete with the starting
     * sandbox and its requester for the CPUs. A run has ended when its init
     * has: its C1 tells us then (SIGUSR1), before its own unmount and exit. */
    if (run_ended && spare_sock < 0)
        make_spare(last_flags);
}

/* A sandbox runs as the same user, so the uid alone does not tell it from its
 * owner: a sandbox that could reach the socket (a grant that exposes the state
 * dir) must not be able to ask for an unconfined run. Every sandbox has its own
 * PID namespace; our clients share ours (the host's, seen at /oldroot/proc). */
static int same_pid_ns(pid_t pid)
{
    /* /proc/PID/status is readable without ptrace rights (which a launcher in
     * its own user namespace never has over host processes); its NSpid line
     * lists one pid per PID namespace from the host's down to the process's. */
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/oldroot/proc/%d/status", (int)pid);
    int fd = pid > 0 ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *l = strstr(buf, "\nNSpid:");
    if (!l)
        return 0;
    l += 7;
    int fields = 0, in = 0;
    for (; *l && *l != '\n'; l++) {
        int digit = *l >= '0' && *l <= '9';
        if (digit && !in)
            fields++;
        in = digit;
    }
    return fields == 1;
}

/* Only our own user (as this user namespace sees it) may ask for runs. */
static void accept_client(void)
{
    int c = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return;
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (nclients >= MAX_CLIENTS || getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0 ||
        cr.uid != getuid() || !same_pid_ns(cr.pid)) {
        close(c);
        return;
    }
    /* The pid was the peer's at connect time; with a pidfd (Linux 6.5+) make
     * sure it still is (not exited and reused while we looked). */
    int pfd = -1;
    socklen_t plen = sizeof pfd;
    if (getsockopt(c, SOL_SOCKET, SK_SO_PEERPIDFD, &pfd, &plen) == 0 && pfd >= 0) {
        struct pollfd pp = {.fd = pfd, .events = POLLIN};
        int gone = poll(&pp, 1, 0) != 0;
        close(pfd);
        if (gone) {
            close(c);
            return;
        }
    }
    hello_done[nclients] = 0;
    clients[nclients++] = c;
}

/* A client's first message: HELLO with an fd of *our* user namespace, which it can
 * only have opened (/proc/OUR_PID/ns/user) with ptrace rights over us: those of a
 * process in the user namespace we were made from (or an ancestor of it), never
 * those of one in a sibling namespace that shares the filesystem (`unshare -Ur`,
 * `bwrap --unshare-user`): its runs would be made outside its own namespaces. We
 * cannot look at the peer's namespace ourselves (no ptrace rights over host
 * processes), so the peer shows us ours. 0: not such a client (close it). */
static int check_hello(int sock)
{
    int fds[MAX_FDS], nfds;
    ssize_t n = recv_msg(sock, fds, &nfds);
    if (n <= 0)
        return 0;
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    struct stat st;
    int ok = n == (ssize_t)sizeof *h && h->magic == SK_MSG_MAGIC && h->type == SK_MSG_HELLO && nfds == 1 &&
             fstat(fds[0], &st) == 0 && st.st_dev == own_userns.st_dev && st.st_ino == own_userns.st_ino;
    close_all(fds, nfds);
    return ok;
}

static int serve_one(int sock);

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    char *end;
    long c = strtol(argv[1], &end, 10);
    if (*end || c < 3 || c > 1 << 20)
        return 2;
    ctl = (int)c;
    self_pid = getpid();
    if (stat("/proc/self/ns/user", &own_userns) < 0)
        return 1;

    /* Hold nothing of the caller's: not its stdio (a reader waiting for EOF
     * would hang), not an fd it left inheritable. */
    int dn = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (dn < 0)
        return 1;
    for (int i = 0; i < 3; i++)
        if (i != dn && dup2(dn, i) < 0)
            return 1;
    if (dn > 2)
        close(dn);
    if (ctl > 3)
        syscall(SYS_close_range, 3, ctl - 1, 0);
    syscall(SYS_close_range, ctl + 1, ~0U, 0);
    fcntl(ctl, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Every signal stays blocked (the mask is inherited from the spawn); SIGCHLD
     * is read from a signalfd. */
    umask(022);

    int fds[MAX_FDS], nfds;
    struct sk_plan base;
    unsigned char *heap = NULL;
    ssize_t n = recv_msg(ctl, fds, &nfds);
    if (n <= 0)
        return 1;
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    int r = read_plan(n, fds, &nfds, &base, &heap);
    /* shared mode: the listening socket rides along; reserved = idle seconds */
    if (r == 0 && nfds == 1) {
        listen_fd = fds[0];
        nfds = 0;
        idle_ms = (long)h->reserved * 1000;
        /* again, here: a client's SO_PEERCRED names the process that last called
         * listen, and a client finds our user namespace through that pid */
        if (listen(listen_fd, 64) < 0)
            r = -errno;
    }
    close_all(fds, nfds);
    if (r < 0 || h->type != SK_MSG_BASE) {
        send_report(ctl, SK_REP_ERROR, SK_STEP_LAUNCHER, r < 0 ? -r : EINVAL, 0, "base plan", -1);
        return 1;
    }
    int detached = 0;
    if (sk_mounts_stage(&base, ctl) < 0 || sk_mounts_ops(&base, ctl, &detached) < 0)
        return 1; /* reported on ctl */
    sk_plan_free(&base);
    free(heap);
    /* Out of the caller's process group: a Ctrl-C meant for the caller must not
     * end the launcher (and every run it holds); a shared one also outlives the
     * caller's terminal session. An explicit SIGTERM does end it. */
    setsid();
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigprocmask(SIG_UNBLOCK, &term, NULL);
    send_report(ctl, SK_REP_READY, 0, 0, 0, NULL, -1);

    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigaddset(&chld, SIGUSR1);
    sigfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd < 0)
        return 1;
    own_mntns = open("/oldroot/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC); /* the host's procfs */
    make_spare(last_flags);
    for (;;) {
        struct pollfd pf[2 + MAX_CLIENTS];
        int np = 0;
        pf[np++] = (struct pollfd){.fd = sigfd, .events = POLLIN};
        pf[np++] = (struct pollfd){.fd = ctl >= 0 ? ctl : listen_fd, .events = POLLIN};
        int have_listen = ctl >= 0 && listen_fd >= 0;
        if (have_listen)
            pf[np++] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        int first_client = np;
        for (int i = 0; i < nclients; i++)
            pf[np++] = (struct pollfd){.fd = clients[i], .events = POLLIN};
        int busy = ctl >= 0 || nclients > 0 || live > (spare_pid > 0 ? 1 : 0);
        int pr = poll(pf, (nfds_t)np, busy ? -1 : (int)idle_ms);
        if (pr < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (pr == 0)
            return 0; /* shared launcher, idle long enough */
        if (pf[0].revents)
            reap_children();
        if (pf[1].revents) {
            if (ctl >= 0) {
                if (serve_one(ctl) == 0) {
                    if (listen_fd < 0)
                        return 0; /* private launcher: the owner is gone */
                    close(ctl);
                    ctl = -1;
                }
            } else {
                accept_client();
            }
        }
        if (have_listen && pf[2].revents)
            accept_client();
        for (int i = np - 1; i >= first_client; i--) {
            int k = i - first_client;
            if (!pf[i].revents)
                continue;
            if (hello_done[k] ? serve_one(pf[i].fd) == 0 : !(hello_done[k] = check_hello(pf[i].fd))) {
                close(pf[i].fd);
                --nclients;
                clients[k] = clients[nclients];
                hello_done[k] = hello_done[nclients];
            }
        }
    }
}

/* One request from a control or client socket; 0 = EOF. */
static int serve_one(int sock)
{
    int fds[MAX_FDS], nfds;
    unsigned char *heap = NULL;
    ssize_t n = recv_msg(sock, fds, &nfds);
    if (n == 0)
        return 0;
    if (n < 0)
        return (errno == EINTR || errno == EMSGSIZE || errno == EAGAIN) ? 1 : 0;
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    struct sk_plan p;
    int r = read_plan(n, fds, &nfds, &p, &heap);
    if (r < 0 || h->type != SK_MSG_RUN || nfds < 3) {
        if (nfds >= 3)
            send_report(fds[2], SK_REP_ERROR, SK_STEP_LAUNCHER, r < 0 ? -r : EINVAL, 0, "run plan", -1);
        close_all(fds, nfds);
        if (r == 0)
            sk_plan_free(&p);
        free(heap);
        return 1;
    }
    unsigned long want = run_ns_flags(&p);
    int inline_plan = !(h->flags & SK_MSG_PLAN_IN_FD);
    if (!(spare_sock >= 0 && spare_flags == want && inline_plan && to_spare(n, fds, nfds) == 0)) {
        pid_t pid = fork();
        if (pid == 0)
            run_child(&p, fds, nfds, hold_slot(nfds));
        if (pid < 0)
            send_report(fds[2], SK_REP_ERROR, SK_STEP_FORK, errno, 0, NULL, -1);
        else
            live++;
    } else {
        spare_pid = -1; /* it is a run now */
    }
    close_all(fds, nfds);
    last_flags = want;
    sk_plan_free(&p);
    free(heap);
    return 1;
}
