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
 *   struct sk_msg_hdr (launcher.h), then the plan part and the run part (wire.c)
 *   inline, or in the last fd (a memfd) with SK_MSG_PLAN_IN_FD.
 *   HELLO (a shared launcher's client, first): an fd of our user namespace (peer.c).
 *   BASE: a plan part alone (idle_seconds for a shared one, with its listening
 *         socket as the one fd): build the base tree; reply on the control socket
 *         with an sk_report (SK_REP_READY or SK_REP_ERROR).
 *   RUN:  fds = report pipe (write end), sync pipe (read end), status socket,
 *         then the slots the run part's fd fields index (stdio, console, cgroup,
 *         the v1 cgroups' tasks files init joins, the hold),
 *         then the fds to pass through (plan->keep_fds names their numbers).
 *         C1 answers on the status socket: SK_REP_INIT with init's pidfd, or
 *         SK_REP_ERROR; later SK_REP_INIT_EXIT with init's wait status.
 *         Init waits on the sync pipe for SK_STAGE_ATTACHED only when the run
 *         part holds it there (hold_before_exec); there is no SK_STAGE_IDMAP for
 *         a run: our maps were written once, before the launcher's own.
 *         The run part's hold_fd: the slot of a *hold* fd, or -1: the session's overlay
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

static int serve_one(int sock);

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    char *end;
    long c = strtol(argv[1], &end, 10);
    if (*end || c < 3 || c > 1 << 20)
        return 2;
    L.ctl = (int)c;
    L.self_pid = getpid();
    if (stat("/proc/self/ns/user", &L.own_userns) < 0)
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
    if (L.ctl > 3)
        syscall(SYS_close_range, 3, L.ctl - 1, 0);
    syscall(SYS_close_range, L.ctl + 1, ~0U, 0);
    fcntl(L.ctl, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Every signal stays blocked (the mask is inherited from the spawn); SIGCHLD
     * is read from a signalfd. */
    umask(022);

    int fds[MAX_FDS], nfds;
    struct sk_plan base;
    unsigned char *heap = NULL;
    ssize_t n = recv_msg(L.ctl, fds, &nfds);
    if (n <= 0)
        return 1;
    const struct sk_msg_hdr *h = msg_hdr();
    int hold;
    int r = read_plan(n, fds, &nfds, &base, &heap, &hold);
    /* shared mode: the listening socket rides along */
    if (r == 0 && nfds == 1) {
        L.listen_fd = fds[0];
        nfds = 0;
        L.idle_ms = (long)h->idle_seconds * 1000;
        /* again, here: a client's SO_PEERCRED names the process that last called
         * listen, and a client finds our user namespace through that pid */
        if (listen(L.listen_fd, 64) < 0)
            r = -errno;
    }
    close_all(fds, nfds);
    if (r < 0 || h->type != SK_MSG_BASE) {
        send_report(L.ctl, SK_REP_ERROR, SK_STEP_LAUNCHER, r < 0 ? -r : EINVAL, 0, "base plan", -1);
        return 1;
    }
    int detached = 0;
    if (sk_mounts_stage(&base, L.ctl) < 0 || sk_mounts_ops(&base, L.ctl, &detached) < 0)
        return 1; /* reported on L.ctl */
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
    send_report(L.ctl, SK_REP_READY, 0, 0, 0, NULL, -1);

    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigaddset(&chld, SIGUSR1);
    L.sigfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (L.sigfd < 0)
        return 1;
    L.own_mntns = open("/oldroot/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC); /* the host's procfs */
    make_spare(L.last_flags);
    for (;;) {
        struct pollfd pf[2 + MAX_CLIENTS];
        int np = 0;
        pf[np++] = (struct pollfd){.fd = L.sigfd, .events = POLLIN};
        pf[np++] = (struct pollfd){.fd = L.ctl >= 0 ? L.ctl : L.listen_fd, .events = POLLIN};
        int have_listen = L.ctl >= 0 && L.listen_fd >= 0;
        if (have_listen)
            pf[np++] = (struct pollfd){.fd = L.listen_fd, .events = POLLIN};
        int first_client = np;
        for (int i = 0; i < L.nclients; i++)
            pf[np++] = (struct pollfd){.fd = L.clients[i], .events = POLLIN};
        int busy = L.ctl >= 0 || L.nclients > 0 || L.live > (L.spare_pid > 0 ? 1 : 0);
        int pr = poll(pf, (nfds_t)np, busy ? -1 : (int)L.idle_ms);
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
            if (L.ctl >= 0) {
                if (serve_one(L.ctl) == 0) {
                    if (L.listen_fd < 0)
                        return 0; /* private launcher: the owner is gone */
                    close(L.ctl);
                    L.ctl = -1;
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
            if (L.hello_done[k] ? serve_one(pf[i].fd) == 0 : !(L.hello_done[k] = check_hello(pf[i].fd))) {
                close(pf[i].fd);
                --L.nclients;
                L.clients[k] = L.clients[L.nclients];
                L.hello_done[k] = L.hello_done[L.nclients];
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
    const struct sk_msg_hdr *h = msg_hdr();
    struct sk_plan p;
    int hold;
    int r = read_plan(n, fds, &nfds, &p, &heap, &hold);
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
    if (!(L.spare_sock >= 0 && L.spare_flags == want && inline_plan && to_spare(n, fds, nfds) == 0)) {
        pid_t pid = fork();
        if (pid == 0)
            run_child(&p, fds, nfds, hold);
        if (pid < 0)
            send_report(fds[2], SK_REP_ERROR, SK_STEP_FORK, errno, 0, NULL, -1);
        else
            L.live++;
    } else {
        L.spare_pid = -1; /* it is a run now */
    }
    close_all(fds, nfds);
    L.last_flags = want;
    sk_plan_free(&p);
    free(heap);
    return 1;
}
