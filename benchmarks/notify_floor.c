/* notify_floor.c: what seccomp user notification itself costs a command on this host,
 * with no sandbox and no stockade: the floor under observe mode's overhead.
 *
 * Runs ARGV bare and under a minimal notifier, round by round, both back to back. The
 * notifier's child installs a filter that returns SECCOMP_RET_USER_NOTIF for execve,
 * open and openat (this machine's numbers; a 64-bit build) and hands the listener to the parent,
 * whose thread answers every notification SECCOMP_USER_NOTIF_FLAG_CONTINUE at once:
 * the kernel's synchronous hand-over where it has it (6.6+), no argument read, no log.
 * With "poll" the thread polls before each receive (as observe mode does before 6.11);
 * else it waits in the receive, which ends with the filter's last task only on 6.11+
 * (older kernels: "poll" is the only mode that ends).
 *
 * "usual" waits in the receive without the synchronous hand-over: what it saves.
 *
 * With "read" (of `once`) the notifier also reads each call's path from the target's
 * memory before it answers (one process_vm_readv of up to 256 bytes, as observe mode's
 * first read of a path is): the least that any observer logging paths must do while
 * the call waits (seccomp_unotify(2): after the answer the memory is the target's again).
 *
 * Usage: notify_floor ROUNDS poll|recv|usual ARGV...
 * Prints one line: rounds, the median bare and notified wall times (ms), the median of
 * the rounds' ratios minus one (%), its quartiles (%), notifications per run, and
 * whether the synchronous hand-over was on (1/0).
 *
 *    or: notify_floor once poll|recv|usual on|off|read ARGV...
 * runs ARGV once, notified (on, read: also reading each path) or not (off), the same fork either way, and exits 0 when
 * it succeeded: timed from outside (bench_observe runs it inside the sandbox, beside
 * the observed runs: the floor under the same conditions). */
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "../csrc/seccomp_notify.h" /* (the flags older headers lack, as observe mode has them) */

static int poll_first, want_sync = 1, sync_taken = -1, read_path;
static long notified, unread;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void *answer(void *arg)
{
    int l = *(int *)arg;
    struct seccomp_notif req;
    struct seccomp_notif_resp resp;
    struct pollfd pf = {.fd = l, .events = POLLIN};
    /* Linux 6.6+ takes it (else the usual wake-up): without it each call wakes the other
     * side on another CPU, an IPI each way (a halted vCPU's wake-up on a VM) */
    int taken = want_sync && ioctl(l, SECCOMP_IOCTL_NOTIF_SET_FLAGS, (__u64)SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP) == 0;
    __atomic_store_n(&sync_taken, taken, __ATOMIC_RELAXED);
    for (;;) {
        if (poll_first) {
            if (poll(&pf, 1, -1) < 0)
                continue;
            if (!(pf.revents & POLLIN))
                break; /* POLLHUP: no task left in the filter */
        }
        memset(&req, 0, sizeof req);
        if (ioctl(l, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) {
            if (poll(&pf, 1, 0) == 1 && (pf.revents & POLLHUP))
                break;
            continue;
        }
        __atomic_add_fetch(&notified, 1, __ATOMIC_RELAXED);
        if (read_path) { /* execve's path is args[0], open's too; openat's args[1] */
            char buf[256];
            int at = req.data.nr == SYS_openat;
            struct iovec lo = {.iov_base = buf, .iov_len = sizeof buf};
            struct iovec re = {.iov_base = (void *)(uintptr_t)req.data.args[at], .iov_len = sizeof buf};
            if (process_vm_readv(req.pid, &lo, 1, &re, 1, 0) < 0)
                __atomic_add_fetch(&unread, 1, __ATOMIC_RELAXED);
        }
        memset(&resp, 0, sizeof resp);
        resp.id = req.id;
        resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        ioctl(l, SECCOMP_IOCTL_NOTIF_SEND, &resp);
    }
    return NULL;
}

static void send_fd(int sock, int fd)
{
    char cb[CMSG_SPACE(sizeof fd)], x = 'l';
    struct iovec io = {.iov_base = &x, .iov_len = 1};
    struct msghdr mh = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = cb, .msg_controllen = sizeof cb};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof fd);
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    if (sendmsg(sock, &mh, 0) != 1)
        _exit(126);
}

static int recv_fd(int sock)
{
    char cb[CMSG_SPACE(sizeof(int))], x;
    struct iovec io = {.iov_base = &x, .iov_len = 1};
    struct msghdr mh = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = cb, .msg_controllen = sizeof cb};
    if (recvmsg(sock, &mh, 0) != 1 || !CMSG_FIRSTHDR(&mh))
        return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&mh)), sizeof fd);
    return fd;
}

/* One run of argv, notified or not: its wall time, or -1. */
static double run(char **argv, int notify)
{
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
        return -1;
    double t0 = now();
    pid_t c = fork();
    if (c == 0) {
        int dn = open("/dev/null", O_WRONLY);
        dup2(dn, 1);
        if (notify) {
#ifdef SYS_open
            const unsigned nrs[3] = {SYS_execve, SYS_open, SYS_openat};
#else
            const unsigned nrs[3] = {SYS_execve, SYS_openat, SYS_openat};
#endif
            struct sock_filter f[] = {
                BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nrs[0], 3, 0),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nrs[1], 2, 0),
                BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nrs[2], 1, 0),
                BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
                BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
            };
            struct sock_fprog p = {.len = sizeof f / sizeof f[0], .filter = f};
            if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
                _exit(126);
            long l = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &p);
            if (l < 0)
                _exit(126);
            send_fd(sp[1], (int)l);
            close((int)l);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    close(sp[1]);
    pthread_t t;
    int l = -1;
    if (notify) {
        l = recv_fd(sp[0]);
        if (l < 0 || pthread_create(&t, NULL, answer, &l) != 0)
            return -1;
    }
    close(sp[0]);
    int st;
    waitpid(c, &st, 0);
    if (notify) {
        pthread_join(t, NULL);
        close(l);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        return -1;
    return now() - t0;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc >= 5 && strcmp(argv[1], "once") == 0) { /* one run, for a benchmark that times it from outside */
        poll_first = strcmp(argv[2], "poll") == 0;
        want_sync = strcmp(argv[2], "usual") != 0;
        read_path = strcmp(argv[3], "read") == 0;
        if (run(argv + 4, read_path || strcmp(argv[3], "on") == 0) < 0)
            return 1;
        return read_path && unread ? 3 : 0; /* (a read that failed: the figure would be too low) */
    }
    if (argc < 4 || (strcmp(argv[2], "poll") && strcmp(argv[2], "recv") && strcmp(argv[2], "usual"))) {
        fprintf(stderr, "usage: notify_floor ROUNDS poll|recv|usual ARGV...\n");
        return 2;
    }
    int n = atoi(argv[1]);
    poll_first = strcmp(argv[2], "poll") == 0;
    want_sync = strcmp(argv[2], "usual") != 0;
    if (n < 1)
        n = 1;
    double *bare = calloc((size_t)n, sizeof *bare), *noti = calloc((size_t)n, sizeof *noti),
           *ratio = calloc((size_t)n, sizeof *ratio);
    if (run(argv + 3, 0) < 0 || run(argv + 3, 1) < 0) { /* warm-up, and a check */
        fprintf(stderr, "notify_floor: the command failed (bare or notified)\n");
        return 1;
    }
    notified = 0;
    for (int i = 0; i < n; i++) {
        double b, o;
        if (i % 2) {
            b = run(argv + 3, 0);
            o = run(argv + 3, 1);
        } else {
            o = run(argv + 3, 1);
            b = run(argv + 3, 0);
        }
        if (b <= 0 || o <= 0)
            return 1;
        bare[i] = b, noti[i] = o, ratio[i] = o / b;
    }
    qsort(bare, (size_t)n, sizeof *bare, cmp);
    qsort(noti, (size_t)n, sizeof *noti, cmp);
    qsort(ratio, (size_t)n, sizeof *ratio, cmp);
    printf("%d %.3f %.3f %.2f %.2f %.2f %ld %d\n", n, bare[n / 2] * 1e3, noti[n / 2] * 1e3, (ratio[n / 2] - 1) * 100,
           (ratio[n / 4] - 1) * 100, (ratio[3 * n / 4] - 1) * 100, notified / n, sync_taken > 0);
    return 0;
}
