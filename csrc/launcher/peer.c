/* peer.c: who may ask a shared launcher for runs: the same user, in our PID
 * namespace, able to reach our user namespace. */
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

/* A sandbox runs as the same user, so the uid alone does not tell it from its
 * owner: a sandbox that could reach the socket (a grant that exposes the state
 * dir) must not be able to ask for an unconfined run. Every sandbox has its own
 * PID namespace; our L.clients share ours (the host's, seen at /oldroot/proc). */
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
void accept_client(void)
{
    int c = accept4(L.listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return;
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (L.nclients >= MAX_CLIENTS || getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0 ||
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
    L.hello_done[L.nclients] = 0;
    L.clients[L.nclients++] = c;
}

/* A client's first message: HELLO with an fd of *our* user namespace, which it can
 * only have opened (/proc/OUR_PID/ns/user) with ptrace rights over us: those of a
 * process in the user namespace we were made from (or an ancestor of it), never
 * those of one in a sibling namespace that shares the filesystem (`unshare -Ur`,
 * `bwrap --unshare-user`): its runs would be made outside its own namespaces. We
 * cannot look at the peer's namespace ourselves (no ptrace rights over host
 * processes), so the peer shows us ours. 0: not such a client (close it). */
int check_hello(int sock)
{
    int fds[MAX_FDS], nfds;
    ssize_t n = recv_msg(sock, fds, &nfds);
    if (n <= 0)
        return 0;
    const struct sk_msg_hdr *h = (const void *)msgbuf;
    struct stat st;
    int ok = n == (ssize_t)sizeof *h && h->magic == SK_MSG_MAGIC && h->type == SK_MSG_HELLO && nfds == 1 &&
             fstat(fds[0], &st) == 0 && st.st_dev == L.own_userns.st_dev && st.st_ino == L.own_userns.st_ino;
    close_all(fds, nfds);
    return ok;
}
