/* spare.c: a spare C1, made ahead with the usual namespaces; reaping children. */
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
    int hold;
    if (read_plan(n, fds, &nfds, &p, &heap, &hold) < 0 || nfds < 3)
        _exit(1);
    run_in_ns(&p, fds, nfds, e, hold);
}

void make_spare(unsigned long flags)
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
    L.spare_sock = sv[0];
    L.spare_flags = flags;
    L.spare_pid = pid;
    L.live++;
}

/* Hand the request, as received, to the spare. 0 when it took it. */
int to_spare(ssize_t n, const int *fds, int nfds)
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
    int sock = L.spare_sock;
    L.spare_sock = -1;
    ssize_t r;
    do
        r = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    close(sock);
    return r == n ? 0 : -1;
}


void reap_children(void)
{
    struct signalfd_siginfo si;
    int run_ended = 0;
    while (read(L.sigfd, &si, sizeof si) > 0)
        if (si.ssi_signo == SIGUSR1)
            run_ended = 1; /* a run child's init ended (see run_in_ns) */
    pid_t w;
    while ((w = waitpid(-1, NULL, WNOHANG)) > 0) {
        L.live--;
        if (w == L.spare_pid)
            L.spare_pid = -1;
        else
            run_ended = 1;
    }
    /* The next run's namespaces are made when a run has ended, not while one
     * starts: on a small machine that work would compete with the starting
     * sandbox and its requester for the CPUs. A run has ended when its init
     * has: its C1 tells us then (SIGUSR1), before its own unmount and exit. */
    if (run_ended && L.spare_sock < 0)
        make_spare(L.last_flags);
}
