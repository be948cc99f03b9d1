/* report.c: the child's records to its parent (struct sk_report on the report pipe).
 *
 * Every unit of the child (caps, init, landlock, mounts, seccomp, the ordered steps)
 * reports through here; this file calls nothing of theirs. Async-signal-safe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
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
