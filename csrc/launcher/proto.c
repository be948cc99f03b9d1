/* proto.c: the control protocol's messages (see main.c for the protocol). */
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

unsigned char msgbuf[INLINE_MAX + sizeof(struct sk_msg_hdr)];

const struct sk_msg_hdr *msg_hdr(void)
{
    return (const void *)msgbuf;
}

void close_all(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* One message and its fds (all close-on-exec). 0 = EOF. */
ssize_t recv_msg(int sock, int *fds, int *nfds)
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

void send_report(int sock, int kind, int step, int err, int value, const char *path, int fd)
{
    send_report2(sock, kind, step, err, value, path, fd, -1);
}

void send_report2(int sock, int kind, int step, int err, int value, const char *path, int fd, int fd2)
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

/* The plan part and the run part: inline after the header, or the whole content
 * of a memfd. *hold: the index in fds of the run's hold fd (the session's overlay
 * lock, the run part names its slot), or -1. 0 or -errno. */
int read_plan(ssize_t n, int *fds, int *nfds, struct sk_plan *p, unsigned char **heap, int *hold)
{
    const struct sk_msg_hdr *h = msg_hdr();
    const unsigned char *body = msgbuf + sizeof *h;
    size_t len = n >= (ssize_t)sizeof *h ? (size_t)n - sizeof *h : 0;
    *heap = NULL;
    *hold = -1;
    if (n < (ssize_t)sizeof *h || h->magic != SK_MSG_MAGIC)
        return -EINVAL;
    if (h->flags & SK_MSG_PLAN_IN_FD) {
        if (*nfds < 1 || len != 0)
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
        body = b;
        len = got;
    }
    if ((size_t)h->plan_len + h->run_len != len || (h->type == SK_MSG_RUN) != (h->run_len > 0))
        return -EINVAL;
    int slot;
    int r = sk_wire_unpack(body, h->plan_len, body + h->plan_len, h->run_len, p, &slot);
    /* slots 0..2 are the report pipe, sync pipe and status socket */
    if (r == 0 && slot >= 3 && slot < *nfds)
        *hold = slot;
    return r;
}
