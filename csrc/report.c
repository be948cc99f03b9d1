/* report.c: the child's records to its parent (struct sk_report on the report pipe).
 *
 * Every unit of the child (caps, init, landlock, mounts, seccomp, the ordered steps)
 * reports through here; this file calls nothing of theirs. Async-signal-safe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "internal.h"

size_t sk_strlen(const char *s)
{
    size_t n = 0;
    while (s && s[n])
        n++;
    return n;
}

void sk_report_fill(struct sk_report *r, int kind, int step, int err, int value, const char *path)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->step = step;
    r->err = err;
    r->value = value;
    if (path) {
        size_t n = sk_strlen(path);
        if (n >= sizeof r->path)
            n = sizeof r->path - 1;
        memcpy(r->path, path, n);
    }
}

void sk_report(int fd, int kind, int step, int err, int value, const char *path)
{
    struct sk_report r;
    sk_report_fill(&r, kind, step, err, value, path);
    /* One record < PIPE_BUF: the write is atomic. */
    while (write(fd, &r, sizeof r) < 0 && errno == EINTR)
        ;
}

/* One byte TAG with FD attached (SCM_RIGHTS) on SOCK: the child's way to hand the
 * parent a descriptor (a pty's master, observe mode's listener). Async-signal-safe. */
ssize_t sk_send_fd(int sock, int fd, char tag)
{
    return sk_send_fd_flags(sock, fd, tag, MSG_NOSIGNAL);
}

ssize_t sk_send_fd_flags(int sock, int fd, char tag, int flags)
{
    struct iovec iov = {.iov_base = &tag, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t w;
    do
        w = sendmsg(sock, &msg, flags);
    while (w < 0 && errno == EINTR);
    return w;
}
