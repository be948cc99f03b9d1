/* observe.c: observe mode (`stockade run --observe`), both halves.
 *
 * Child side (sk_observe_child, async-signal-safe): init, after the policy filter,
 * installs the observe filter (compiled by the parent: SECCOMP_RET_USER_NOTIF for
 * the observed syscalls) with SECCOMP_FILTER_FLAG_NEW_LISTENER, and sends the
 * listener to the supervisor over plan->observe_sock. The filter is inherited by
 * the command and every descendant. init's own sendmsg of the listener is the one
 * call the filter lets through unnotified (its fd argument: SK_OBSERVE_SOCK_K,
 * replaced here by the socket's number); init makes no other observed call.
 *
 * Supervisor side (observe_loop, in a thread of the supervisor made here: it never
 * needs the GIL): receive each notification, read its argument from the target's
 * memory (process_vm_readv), answer CONTINUE (the kernel accepts the answer only
 * while the notification is still valid: then what was read was the target's),
 * append a record to a batch that the supervisor takes from memory (sk_observe_take). The kernel runs the call itself after CONTINUE, rereading the
 * arguments: what we read is for the log only (seccomp_unotify(2), TOCTOU), never a
 * decision. The loop never blocks on the target: each read is one syscall that fails
 * at once on a bad address.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "seccomp_notify.h"

#define SK_OBSERVE_MAX_INSNS 256

/* ------------------------------------------------------------------ child side */

int sk_observe_child(const struct sk_plan *p, int rep)
{
    struct sock_filter f[SK_OBSERVE_MAX_INSNS];
    size_t n = p->observe_len / sizeof(struct sock_filter);
    if (!p->observe_bpf || p->observe_len % sizeof(struct sock_filter) || n == 0 || n > SK_OBSERVE_MAX_INSNS) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_OBSERVE, EINVAL, 0, "observe bpf length");
        return -1;
    }
    memcpy(f, p->observe_bpf, p->observe_len);
    for (size_t i = 0; i < n; i++)
        if (BPF_CLASS(f[i].code) == BPF_JMP && f[i].k == (uint32_t)SK_OBSERVE_SOCK_K)
            f[i].k = (uint32_t)p->observe_sock;
    struct sock_fprog prog = {.len = (unsigned short)n, .filter = f};
    /* Linux 5.19+: once the supervisor has received a notification, the task waits
     * killable-only, so a signal no longer turns the call into EINTR (it still can in
     * the short time before the receive); older kernels refuse the flag with EINVAL. */
    long fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                      SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV, &prog);
    if (fd < 0 && errno == EINVAL)
        fd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
    if (fd < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_OBSERVE, errno, 0, "SECCOMP_FILTER_FLAG_NEW_LISTENER");
        return -1;
    }
    int lfd = (int)fd;
    /* (the one sendmsg the filter lets through: this socket's number and these flags) */
    ssize_t w = sk_send_fd_flags(p->observe_sock, lfd, 'L', SK_OBSERVE_HANDOFF_FLAGS);
    if (w != 1) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_OBSERVE, w < 0 ? errno : EIO, 0, "send the listener");
        return -1;
    }
    /* Nothing of the sandbox keeps the listener (a command holding it could answer
     * its own notifications), nor the socket. */
    close(lfd);
    close(p->observe_sock);
    return 0;
}

/* ------------------------------------------------------------------ supervisor side */

#define OBS_PATH_MAX 4096
#define OBS_ADDR_MAX 128
#define OBS_BUF (1 << 16)
/* Records are handed over in batches this long at least: the supervisor classifies
 * them while the command runs (on another CPU), so the run's end is not kept waiting
 * for all. A batch goes when a record comes this long after its first one, when the
 * buffer is full, and at the end; a loop that polls also sends it when the command has
 * been quiet this long (one that waits in the receive cannot see the time). */
#define OBS_FLUSH_MS 10

/* What the loop has handed over and the supervisor has not taken yet (sk_observe_take):
 * memory, not a file, so a batch costs the loop no syscall but the reader's wake-up. */
struct obs_shared {
    pthread_mutex_t mu;
    unsigned char *data;
    size_t len, cap;
};
/* Records the supervisor leaves untaken beyond this are dropped (and counted): its loop
 * takes them every batch, so only a supervisor stuck elsewhere gets here. */
#define OBS_PENDING_MAX ((size_t)64 << 20)

struct obs_out {
    struct obs_shared *sh;
    size_t len, nrec;
    long long since_ms; /* when the oldest buffered record came */
    unsigned long long lost;
    unsigned char buf[OBS_BUF];
};

static void out_flush(struct obs_out *o)
{
    if (o->len == 0)
        return;
    struct obs_shared *sh = o->sh;
    int kept = 1;
    pthread_mutex_lock(&sh->mu);
    if (sh->len + o->len > sh->cap) {
        size_t cap = sh->cap ? sh->cap : (size_t)OBS_BUF * 4;
        while (cap < sh->len + o->len)
            cap *= 2;
        unsigned char *d = cap <= OBS_PENDING_MAX ? realloc(sh->data, cap) : NULL;
        if (d)
            sh->data = d, sh->cap = cap;
        else
            kept = 0;
    }
    if (kept) {
        memcpy(sh->data + sh->len, o->buf, o->len);
        sh->len += o->len;
    }
    pthread_mutex_unlock(&sh->mu);
    if (!kept)
        o->lost += o->nrec;
    o->len = 0;
    o->nrec = 0;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO: no syscall */
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void out_rec(struct obs_out *o, struct sk_obs_rec *r, const void *data, size_t n)
{
    r->data_len = (unsigned int)n;
    r->len = (unsigned int)(sizeof *r + n);
    if (o->len + r->len > sizeof o->buf)
        out_flush(o);
    long long t = now_ms();
    if (o->len == 0)
        o->since_ms = t;
    memcpy(o->buf + o->len, r, sizeof *r);
    memcpy(o->buf + o->len + sizeof *r, data, n);
    o->len += r->len;
    o->nrec++;
    if (t - o->since_ms >= OBS_FLUSH_MS)
        out_flush(o);
}

/* Read n bytes at addr of pid's memory. 0 or -errno. */
static int read_mem(int pid, uint64_t addr, void *buf, size_t n)
{
    struct iovec l = {.iov_base = buf, .iov_len = n};
    struct iovec r = {.iov_base = (void *)(uintptr_t)addr, .iov_len = n};
    ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got < 0)
        return -errno;
    return (size_t)got == n ? 0 : -EFAULT;
}

/* A NUL-terminated string at addr, read a page at a time (a string that ends
 * before an unmapped page is still read). Its length, or -errno; *trunc when it
 * did not fit. */
static long read_str(int pid, uint64_t addr, char *buf, size_t cap, int *trunc)
{
    size_t got = 0;
    *trunc = 0;
    if (addr == 0)
        return -EFAULT;
    size_t chunk = 256; /* most paths fit: no page-sized copy for a short one */
    while (got < cap - 1) {
        size_t page_left = 4096 - (size_t)((addr + got) & 4095);
        size_t want = cap - 1 - got < page_left ? cap - 1 - got : page_left;
        if (want > chunk)
            want = chunk;
        chunk = 4096;
        struct iovec l = {.iov_base = buf + got, .iov_len = want};
        struct iovec r = {.iov_base = (void *)(uintptr_t)(addr + got), .iov_len = want};
        ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n <= 0) {
            if (got)
                break;
            return n < 0 ? -errno : -EFAULT;
        }
        char *z = memchr(buf + got, 0, (size_t)n);
        if (z)
            return z - buf;
        got += (size_t)n;
    }
    buf[got] = '\0';
    *trunc = 1;
    return (long)got;
}

static size_t num(char *out, long v)
{
    char rev[24];
    size_t k = 0, n = 0;
    if (v < 0) {
        out[n++] = '-';
        v = -v;
    }
    do {
        rev[k++] = (char)('0' + v % 10);
        v /= 10;
    } while (v && k < sizeof rev);
    while (k)
        out[n++] = rev[--k];
    out[n] = '\0';
    return n;
}

/* /proc/PID of the processes seen last, kept open: a relative path's directory is then
 * one readlinkat (fd/N or cwd) instead of a walk of /proc/PID/... each time. An entry
 * of a process that has exited fails (the directory belongs to that process, never
 * to a later one with the same pid) and is opened again. */
#define OBS_PROC_CACHE 32
struct proc_cache {
    int pid[OBS_PROC_CACHE];
    int fd[OBS_PROC_CACHE];  /* /proc/PID */
    int fds[OBS_PROC_CACHE]; /* /proc/PID/fd, opened when first needed */
    unsigned int next;
};

static void proc_forget(struct proc_cache *pc, int i)
{
    if (pc->fd[i] >= 0)
        close(pc->fd[i]);
    if (pc->fds[i] >= 0)
        close(pc->fds[i]);
    pc->fd[i] = pc->fds[i] = -1;
}

/* The cache slot of pid's /proc directories (opened again when fresh), or -1. */
static int proc_slot(struct proc_cache *pc, int pid, int fresh)
{
    for (int i = 0; i < OBS_PROC_CACHE; i++)
        if (pc->fd[i] >= 0 && pc->pid[i] == pid) {
            if (!fresh)
                return i;
            proc_forget(pc, i);
        }
    char path[32];
    memcpy(path, "/proc/", 6);
    num(path + 6, pid);
    int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int k = (int)(pc->next++ % OBS_PROC_CACHE);
    proc_forget(pc, k);
    pc->pid[k] = pid;
    pc->fd[k] = fd;
    return k;
}

/* The directory a relative path of pid's is resolved from: its cwd (AT_FDCWD) or
 * the directory fd, as the sandbox names it. Its length, or -errno. */
static long dir_of(struct proc_cache *pc, int pid, int dirfd, char *out, size_t cap)
{
    char link[24];
    if (dirfd == AT_FDCWD)
        memcpy(link, "cwd", 4);
    else
        num(link, dirfd);
    for (int attempt = 0; attempt < 2; attempt++) {
        int k = proc_slot(pc, pid, attempt);
        if (k < 0)
            return -errno;
        int at = pc->fd[k];
        if (dirfd != AT_FDCWD) { /* fd/N: one lookup in a directory kept open */
            if (pc->fds[k] < 0)
                pc->fds[k] = openat(pc->fd[k], "fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
            if ((at = pc->fds[k]) < 0) {
                if (errno != ESRCH && errno != ENOENT)
                    return -errno;
                continue;
            }
        }
        ssize_t r = readlinkat(at, link, out, cap - 1);
        if (r >= 0) {
            out[r] = '\0';
            return r;
        }
        if (errno != ESRCH && errno != ENOENT)
            return -errno;
    }
    return -ENOENT;
}

/* Lexically normalize an absolute path in place: "//", "/./" and "/x/../". Its length. */
static size_t normalize(char *p)
{
    size_t w = 0, i = 0, len = strlen(p);
    while (i < len) {
        while (i < len && p[i] == '/')
            i++;
        size_t s = i;
        while (i < len && p[i] != '/')
            i++;
        size_t cl = i - s;
        if (cl == 0 || (cl == 1 && p[s] == '.'))
            continue;
        if (cl == 2 && p[s] == '.' && p[s + 1] == '.') {
            while (w > 0 && p[w - 1] != '/')
                w--;
            if (w > 0)
                w--;
            continue;
        }
        p[w++] = '/';
        memmove(p + w, p + s, cl);
        w += cl;
    }
    if (w == 0)
        p[w++] = '/';
    p[w] = '\0';
    return w;
}

static int under(const char *p, size_t plen, const char *prefix, size_t n)
{
    if (n == 0)
        return 0;
    if (n == 1 && prefix[0] == '/')
        return 1;
    return plen >= n && memcmp(p, prefix, n) == 0 && (p[n] == '\0' || p[n] == '/');
}

struct obs_call {
    int kind;
    int path_arg; /* index of the path (or sockaddr) argument */
    int dirfd_arg; /* -1: relative to the cwd */
    int flags_arg; /* -1: none */
};

/* x86_64 and aarch64 numbers; the parent's filter notifies only these. */
static int classify(int nr, struct obs_call *c)
{
    c->dirfd_arg = -1;
    c->flags_arg = -1;
    switch (nr) {
#if defined(__x86_64__)
    case 59: /* execve */
        c->kind = SK_OBS_EXEC, c->path_arg = 0;
        return 1;
    case 322: /* execveat */
        c->kind = SK_OBS_EXEC, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 4;
        return 1;
    case 2: /* open */
        c->kind = SK_OBS_OPEN, c->path_arg = 0, c->flags_arg = 1;
        return 1;
    case 85: /* creat */
        c->kind = SK_OBS_OPEN, c->path_arg = 0;
        return 1;
    case 257: /* openat */
        c->kind = SK_OBS_OPEN, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 2;
        return 1;
    case 437: /* openat2: flags from struct open_how */
        c->kind = SK_OBS_OPEN, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 2;
        return 1;
    case 42: /* connect */
        c->kind = SK_OBS_CONNECT, c->path_arg = 1, c->flags_arg = 2;
        return 1;
    case 44: /* sendto */
        c->kind = SK_OBS_SENDTO, c->path_arg = 4, c->flags_arg = 5;
        return 1;
    case 46: /* sendmsg */
        c->kind = SK_OBS_SENDMSG, c->path_arg = 1;
        return 1;
#elif defined(__aarch64__)
    case 221:
        c->kind = SK_OBS_EXEC, c->path_arg = 0;
        return 1;
    case 281:
        c->kind = SK_OBS_EXEC, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 4;
        return 1;
    case 56:
        c->kind = SK_OBS_OPEN, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 2;
        return 1;
    case 437:
        c->kind = SK_OBS_OPEN, c->path_arg = 1, c->dirfd_arg = 0, c->flags_arg = 2;
        return 1;
    case 203:
        c->kind = SK_OBS_CONNECT, c->path_arg = 1, c->flags_arg = 2;
        return 1;
    case 206:
        c->kind = SK_OBS_SENDTO, c->path_arg = 4, c->flags_arg = 5;
        return 1;
    case 211:
        c->kind = SK_OBS_SENDMSG, c->path_arg = 1;
        return 1;
#endif
    default:
        return 0;
    }
}

static int is_openat2(int nr)
{
#if defined(__x86_64__) || defined(__aarch64__)
    return nr == 437;
#else
    return 0;
#endif
}

static int is_creat(int nr)
{
#if defined(__x86_64__)
    return nr == 85;
#else
    (void)nr;
    return 0;
#endif
}

#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL
#endif

/* The thread group of thread tid (its /proc/TID/status "Tgid:"), or -1. */
static int tgid_of(struct proc_cache *pc, int tid)
{
    int fd = -1;
    for (int fresh = 0; fresh < 2 && fd < 0; fresh++) { /* (a cached entry may be an exited thread's) */
        int k = proc_slot(pc, tid, fresh);
        fd = k < 0 ? -1 : openat(pc->fd[k], "status", O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0)
        return -1;
    char buf[1024];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    const char *t = strstr(buf, "\nTgid:");
    return t ? atoi(t + 7) : -1;
}

/* The type of pid's socket fd (SOCK_STREAM...), or 0 when it cannot be seen: a TCP
 * connect is what Landlock's network rules govern. A notification names the calling
 * thread, and pidfd_open takes a thread that leads no group only with PIDFD_THREAD
 * (Linux 6.9+); before that, its group's leader, which shares its descriptors. */
static int sock_type(struct proc_cache *pc, int pid, int fd)
{
    int pfd = (int)syscall(SYS_pidfd_open, pid, 0); /* (a thread: EINVAL, or ENOENT on 6.9+) */
    if (pfd < 0 && (errno == EINVAL || errno == ENOENT))
        pfd = (int)syscall(SYS_pidfd_open, pid, PIDFD_THREAD);
    if (pfd < 0 && (errno == EINVAL || errno == ENOENT)) {
        int tgid = tgid_of(pc, pid);
        if (tgid > 0 && tgid != pid)
            pfd = (int)syscall(SYS_pidfd_open, tgid, 0);
    }
    if (pfd < 0)
        return 0;
    int s = (int)syscall(SYS_pidfd_getfd, pfd, fd, 0);
    close(pfd);
    if (s < 0)
        return 0;
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(s, SOL_SOCKET, SO_TYPE, &type, &len) < 0)
        type = 0;
    close(s);
    return type;
}

/* The argument of one notification, read into data; its length (0: nothing read,
 * r->flags and r->err say why). */
static size_t take_arg(struct proc_cache *pc, const struct seccomp_notif *n, const struct obs_call *c,
                       struct sk_obs_rec *r, char *data, size_t cap)
{
    int pid = (int)n->pid;
    const uint64_t *a = (const uint64_t *)n->data.args; /* (__u64 is unsigned long long) */
    if (c->kind == SK_OBS_EXEC || c->kind == SK_OBS_OPEN) {
        int trunc = 0;
        if (c->flags_arg >= 0)
            r->arg = a[c->flags_arg];
        if (is_creat(n->data.nr))
            r->arg = O_CREAT | O_WRONLY | O_TRUNC;
        if (is_openat2(n->data.nr)) {
            uint64_t how = 0;
            r->arg = read_mem(pid, a[2], &how, sizeof how) == 0 ? how : 0;
        }
        char path[OBS_PATH_MAX];
        long len = read_str(pid, a[c->path_arg], path, sizeof path, &trunc);
        if (len < 0) {
            r->flags |= SK_OBS_F_UNREADABLE;
            r->err = (int)-len;
            return 0;
        }
        if (trunc)
            r->flags |= SK_OBS_F_TRUNCATED;
        if (path[0] == '/' && (size_t)len < cap) {
            memcpy(data, path, (size_t)len + 1);
            return normalize(data);
        }
        /* relative (or execveat's AT_EMPTY_PATH ""): from its directory */
        int dirfd = c->dirfd_arg >= 0 ? (int)a[c->dirfd_arg] : AT_FDCWD;
        long dl = dir_of(pc, pid, dirfd, data, cap);
        if (dl < 0 || data[0] != '/' || (size_t)dl + 1 + (size_t)len + 1 > cap) {
            r->flags |= SK_OBS_F_RELATIVE;
            if ((size_t)len + 1 > cap)
                len = (long)cap - 1;
            memcpy(data, path, (size_t)len);
            data[len] = '\0';
            return (size_t)len;
        }
        if (len > 0) {
            data[dl] = '/';
            memcpy(data + dl + 1, path, (size_t)len + 1);
        }
        return normalize(data);
    }
    /* connect(fd, addr, len), sendto(.., addr, len), sendmsg(fd, msghdr, ..) */
    uint64_t addr = a[c->path_arg], alen;
    if (c->kind == SK_OBS_SENDMSG) {
        struct {
            uint64_t name;
            uint32_t namelen;
        } mh;
        int e = read_mem(pid, addr, &mh, sizeof mh);
        if (e < 0) {
            r->flags |= SK_OBS_F_UNREADABLE;
            r->err = -e;
            return 0;
        }
        addr = mh.name;
        alen = mh.namelen;
    } else {
        alen = c->kind == SK_OBS_CONNECT ? a[2] : a[5];
    }
    if (c->kind == SK_OBS_CONNECT)
        r->arg = (uint64_t)sock_type(pc, pid, (int)a[0]);
    if (addr == 0 || alen == 0)
        return 0; /* a connected socket's send: no target of its own */
    if (alen > cap)
        alen = cap;
    if (alen > OBS_ADDR_MAX)
        alen = OBS_ADDR_MAX;
    int e = read_mem(pid, addr, data, (size_t)alen);
    if (e < 0) {
        r->flags |= SK_OBS_F_UNREADABLE;
        r->err = -e;
        return 0;
    }
    return (size_t)alen;
}

static int watched(const char *p, size_t plen, const char *const *watch, size_t n_watch)
{
    for (size_t i = 0; i < n_watch; i++)
        if (under(p, plen, watch[i], strlen(watch[i])))
            return 1;
    return 0;
}

/* The running kernel is major.minor or later (its release as uname says it). */
static int kernel_at_least(int major, int minor)
{
    struct utsname u;
    int ma = 0, mi = 0;
    if (uname(&u) != 0 || sscanf(u.release, "%d.%d", &ma, &mi) != 2)
        return 0;
    return ma > major || (ma == major && mi >= minor);
}

/* Answer every notification of listener until no task is left in its filter (or stop_fd
 * is readable), handing the records over through sh. 0 or -errno. */
static int observe_loop(int listener, int stop_fd, struct obs_shared *sh, int poll_first,
                        const char *skip_prefix, const char *const *watch, size_t n_watch,
                        struct sk_observe_stats *st)
{
    struct seccomp_notif_sizes sizes;
    memset(st, 0, sizeof *st);
    if (syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sizes) < 0)
        return -errno;
    /* The kernel's structs may be larger than ours (newer kernels): receive into a
     * buffer of its size. */
    union {
        struct seccomp_notif n;
        unsigned char raw[512];
    } req;
    union {
        struct seccomp_notif_resp r;
        unsigned char raw[512];
    } resp;
    if (sizes.seccomp_notif > sizeof req || sizes.seccomp_notif_resp > sizeof resp)
        return -EOVERFLOW;
    struct obs_out *o = malloc(sizeof *o); /* 64 KiB: off the thread's stack */
    if (!o)
        return -ENOMEM;
    o->sh = sh;
    o->len = 0;
    o->nrec = 0;
    o->since_ms = 0;
    o->lost = 0;
    size_t plen = skip_prefix ? strlen(skip_prefix) : 0;
    /* Linux 6.6+: the target and this thread hand over on one CPU (each notification
     * is a synchronous round trip); older kernels refuse the flag, and wake as usual.
     * Linux 6.11+ also ends a waiting receive when the filter's last task is gone
     * ("seccomp: interrupt SECCOMP_IOCTL_NOTIF_RECV when all users have exited"): the
     * loop then waits in the receive itself, with no poll before each notification
     * (a poll per call is a syscall and a wake-up more on the command's path). Before
     * 6.11 a waiting receive would outlive the sandbox: poll, then receive. */
    int sync_wake = ioctl(listener, SECCOMP_IOCTL_NOTIF_SET_FLAGS, (__u64)SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP) == 0;
    int direct = sync_wake && !poll_first && kernel_at_least(6, 11);
    st->handover = (sync_wake ? SK_OBS_SAME_CPU : 0) | (direct ? SK_OBS_IN_RECEIVE : 0);
    char data[OBS_PATH_MAX + 1];
    struct proc_cache pc;
    for (int i = 0; i < OBS_PROC_CACHE; i++)
        pc.fd[i] = pc.fds[i] = -1, pc.pid[i] = 0;
    pc.next = 0;
    struct pollfd pf[2] = {{.fd = listener, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
    int ret = 0;
    for (;;) {
        int pr = 1;
        if (direct) {
            pf[0].revents = POLLIN;
        } else {
            pr = poll(pf, stop_fd >= 0 ? 2 : 1, o->len ? OBS_FLUSH_MS : -1);
        }
        if (pr == 0) {
            out_flush(o); /* the command is quiet: hand over what it did so far */
            continue;
        }
        if (pr < 0) {
            if (errno == EINTR)
                continue;
            ret = -errno;
            break;
        }
        if (pf[0].revents & POLLIN) {
            memset(req.raw, 0, sizes.seccomp_notif);
            if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) {
                int e = errno;
                if (direct && (e == ENOENT || e == EINTR)) {
                    /* no notification: the filter's last task is gone (the receive then
                     * fails at once, every time), the target died first, or a stop was
                     * asked for (seen only here: a receive that waits sees no fd) */
                    struct pollfd q[2] = {{.fd = listener, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
                    if (poll(q, stop_fd >= 0 ? 2 : 1, 0) > 0 && ((q[0].revents & (POLLHUP | POLLERR | POLLNVAL)) || q[1].revents))
                        break;
                    continue;
                }
                if (e == EINTR || e == ENOENT)
                    continue; /* ENOENT: the target died before we took it */
                ret = -e;
                break;
            }
            struct seccomp_notif *n = &req.n;
            st->notified++;
            struct sk_obs_rec rec;
            memset(&rec, 0, sizeof rec);
            struct obs_call c;
            size_t dl = 0;
            int known = classify(n->data.nr, &c);
            if (known) {
                rec.kind = (unsigned short)c.kind;
                rec.pid = (int)n->pid;
                rec.nr = n->data.nr;
                dl = take_arg(&pc, n, &c, &rec, data, sizeof data);
            }
            /* The answer is the validity check (one syscall less per call than
             * SECCOMP_IOCTL_NOTIF_ID_VALID): the kernel accepts it only while the target
             * still waits in this call, i.e. it was there through our read, and what
             * we read was the target's; ENOENT: it was interrupted or died meanwhile. */
            memset(resp.raw, 0, sizes.seccomp_notif_resp);
            resp.r.id = n->id;
            resp.r.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
            int sent;
            while ((sent = ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp)) < 0 && errno == EINTR)
                ;
            int valid = sent == 0;
            if (!known)
                continue;
            if (!valid) {
                st->stale++;
                continue;
            }
            if (rec.flags & SK_OBS_F_UNREADABLE)
                st->unreadable++;
            if (c.kind == SK_OBS_OPEN && !(rec.flags & (SK_OBS_F_UNREADABLE | SK_OBS_F_RELATIVE)) &&
                under(data, dl, skip_prefix, plen) && !watched(data, dl, watch, n_watch)) {
                st->skipped++;
                continue;
            }
            if ((c.kind == SK_OBS_SENDTO || c.kind == SK_OBS_SENDMSG) && dl == 0 &&
                !(rec.flags & SK_OBS_F_UNREADABLE)) {
                st->skipped++; /* no target of its own (a connected socket) */
                continue;
            }
            out_rec(o, &rec, data, dl);
            st->logged++;
            continue;
        }
        if (pf[0].revents & (POLLHUP | POLLERR | POLLNVAL))
            break; /* no task left in the filter */
        if (pf[1].revents)
            break;
    }
    out_flush(o);
    for (int i = 0; i < OBS_PROC_CACHE; i++)
        proc_forget(&pc, i);
    st->lost = o->lost;
    free(o);
    return ret;
}

/* The listener's fd from init's one message on sock (SCM_RIGHTS), or -errno. */
static int take_listener(int sock, int stop_fd)
{
    struct pollfd pf[2] = {{.fd = sock, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
    for (;;) {
        int pr = poll(pf, stop_fd >= 0 ? 2 : 1, -1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0)
            return -errno;
        if (pf[1].revents)
            return -ENOMSG;
        break;
    }
    char tag;
    struct iovec iov = {.iov_base = &tag, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t r;
    do
        r = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    while (r < 0 && errno == EINTR);
    if (r < 0)
        return -errno;
    int fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int got;
            memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
            if (fd < 0)
                fd = got;
            else
                close(got); /* one listener is all a sandbox sends */
        }
    }
    return fd >= 0 ? fd : -ENOMSG;
}

/* Receive the listener init sends over sock, then observe_loop until the sandbox is
 * gone; the listener is closed after. -ENOMSG: the sandbox ended (sock's EOF) or stop_fd
 * became readable before a listener came. */
static int observe_serve(int sock, int stop_fd, struct obs_shared *sh, int poll_first,
                         const char *skip_prefix, const char *const *watch, size_t n_watch,
                         struct sk_observe_stats *st)
{
    memset(st, 0, sizeof *st);
    int listener = take_listener(sock, stop_fd);
    if (listener < 0)
        return listener;
    int r = observe_loop(listener, stop_fd, sh, poll_first, skip_prefix, watch, n_watch, st);
    close(listener); /* (a task left would now get ENOSYS: there is none, or it is being killed) */
    return r;
}

/* ---- the thread that serves, made here: pthread_create does not wait for it to be
 * scheduled (a Python thread's start does, which costs a wake-up of an idle CPU on the
 * run's path), and it never needs the GIL. */

struct sk_observer {
    pthread_t thread;
    int sock, stop_fd, poll_first;
    char *prefix;
    char **watch;
    size_t n_watch;
    struct obs_shared sh;
    struct sk_observe_stats st;
    int result;
    int joined;
};

static void observer_free(struct sk_observer *h)
{
    for (size_t i = 0; i < h->n_watch; i++)
        free(h->watch[i]);
    free(h->watch);
    free(h->prefix);
    free(h->sh.data);
    pthread_mutex_destroy(&h->sh.mu);
    free(h);
}

static void *observer_main(void *arg)
{
    struct sk_observer *h = arg;
    h->result = observe_serve(h->sock, h->stop_fd, &h->sh, h->poll_first, h->prefix,
                              (const char *const *)h->watch, h->n_watch, &h->st);
    return NULL;
}

void *sk_observe_spawn(int sock, int stop_fd, int poll_first, const char *skip_prefix, const char *const *watch,
                       size_t n_watch)
{
    int e;
    struct sk_observer *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    pthread_mutex_init(&h->sh.mu, NULL);
    h->sock = sock, h->stop_fd = stop_fd, h->poll_first = poll_first;
    h->prefix = strdup(skip_prefix ? skip_prefix : "");
    h->watch = calloc(n_watch ? n_watch : 1, sizeof *h->watch);
    if (!h->prefix || !h->watch)
        goto fail;
    for (; h->n_watch < n_watch; h->n_watch++)
        if (!(h->watch[h->n_watch] = strdup(watch[h->n_watch])))
            goto fail;
    /* every signal blocked in the thread: the process's signals stay the main thread's */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    e = pthread_create(&h->thread, NULL, observer_main, h);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        errno = e;
        goto fail;
    }
    return h;
fail:
    e = errno;
    observer_free(h);
    errno = e;
    return NULL;
}

size_t sk_observe_take(void *handle, unsigned char **data)
{
    struct sk_observer *h = handle;
    pthread_mutex_lock(&h->sh.mu);
    size_t n = h->sh.len;
    *data = n ? h->sh.data : NULL;
    if (n) /* (an empty buffer stays for the next batch) */
        h->sh.data = NULL, h->sh.len = h->sh.cap = 0;
    pthread_mutex_unlock(&h->sh.mu);
    return n;
}

void sk_observe_free(void *data)
{
    free(data);
}

int sk_observe_join(void *handle, int timeout_ms, struct sk_observe_stats *st, int *result)
{
    struct sk_observer *h = handle;
    if (!h->joined) {
        int e;
        if (timeout_ms >= 0) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_sec += timeout_ms / 1000;
            t.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
            if (t.tv_nsec >= 1000000000L)
                t.tv_sec++, t.tv_nsec -= 1000000000L;
            e = pthread_timedjoin_np(h->thread, NULL, &t);
        } else {
            e = pthread_join(h->thread, NULL);
        }
        if (e)
            return -e;
        h->joined = 1;
    }
    *st = h->st;
    *result = h->result;
    return 0;
}

void sk_observe_release(void *handle)
{
    observer_free(handle); /* (joined: nothing of the thread is left to use it) */
}
