/* child.c: the ordered steps of a sandbox's child, between clone and init.
 *
 * Runs in a copy of a possibly multi-threaded process: raw syscalls only where
 * glibc would consult its thread list (set*id), no malloc, no stdio. A cold
 * start enters at sk_child_main (spawn.c clones it); a launcher's run child at
 * sk_run_child (its namespaces and base tree already made).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <linux/securebits.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <termios.h>
#include <unistd.h>

#include "internal.h"

#define FAIL(step, path) \
    do { sk_report(rep, SK_REP_ERROR, (step), errno, 0, (path)); _exit(125); } while (0)

static void reset_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; s++)
        if (s != SIGKILL && s != SIGSTOP)
            sigaction(s, &sa, NULL); /* glibc-reserved signals fail: harmless */
}

static void lo_up(int rep)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        FAIL(SK_STEP_LO_UP, "socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    memcpy(ifr.ifr_name, "lo", 3);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        FAIL(SK_STEP_LO_UP, "SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        FAIL(SK_STEP_LO_UP, "SIOCSIFFLAGS lo");
    close(s);
}

/* Put stdio[i] on fd i without clobbering a source that sits on another 0..2. */
static void setup_stdio(const struct sk_plan *p, const int *stdio, int rep)
{
    int src[3];
    (void)p;
    for (int i = 0; i < 3; i++) {
        src[i] = stdio[i];
        if (src[i] >= 0 && src[i] < 3 && src[i] != i) {
            src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 3);
            if (src[i] < 0)
                FAIL(SK_STEP_STDIO, "F_DUPFD");
        }
    }
    for (int i = 0; i < 3; i++) {
        if (src[i] < 0)
            continue;
        if (src[i] == i) {
            int fl = fcntl(i, F_GETFD);
            if (fl < 0 || fcntl(i, F_SETFD, fl & ~FD_CLOEXEC) < 0)
                FAIL(SK_STEP_STDIO, "F_SETFD");
        } else if (dup2(src[i], i) < 0) {
            FAIL(SK_STEP_STDIO, "dup2");
        }
    }
}

/* Close every fd >= 3 except the report pipe and the fds asked for. With
 * keep_src (a CLI server's supervisor: it holds its client's fds under other
 * numbers, and its own fds may sit on the numbers asked for), each passed fd
 * first moves from keep_src[i] to keep_fds[i]: the report pipe and every
 * source go above the highest number asked for, then dup2 puts each in place.
 * Returns the report pipe's fd (moved or not). */
static int close_fds(const struct sk_plan *p, int rep)
{
    int keep[68];
    size_t n = 0;
    if (p->keep_src) {
        int floor = 2, src[64];
        for (size_t i = 0; i < p->n_keep_fds && i < 64; i++)
            if (p->keep_fds[i] > floor)
                floor = p->keep_fds[i];
        if (rep <= floor) {
            int r = fcntl(rep, F_DUPFD_CLOEXEC, floor + 1);
            if (r < 0)
                FAIL(SK_STEP_CLOSE_FDS, "F_DUPFD");
            rep = r;
        }
        for (size_t i = 0; i < p->n_keep_fds && i < 64; i++) {
            src[i] = p->keep_fds[i] < 3 ? -1 : fcntl(p->keep_src[i], F_DUPFD_CLOEXEC, floor + 1);
            if (p->keep_fds[i] >= 3 && src[i] < 0)
                FAIL(SK_STEP_CLOSE_FDS, "pass-fd");
        }
        for (size_t i = 0; i < p->n_keep_fds && i < 64; i++)
            if (src[i] >= 0 && dup2(src[i], p->keep_fds[i]) < 0)
                FAIL(SK_STEP_CLOSE_FDS, "pass-fd");
    }
    keep[n++] = rep;
    if (p->serve_fd >= 3)
        keep[n++] = p->serve_fd; /* a living sandbox's channel to its holder (init.c) */
    if (p->observe_sock >= 3)
        keep[n++] = p->observe_sock; /* observe mode: the listener goes over it (observe.c) */
    for (size_t i = 0; i < p->n_keep_fds && n < 67; i++) {
        int fd = p->keep_fds[i];
        if (fd < 3)
            continue;
        int fl = fcntl(fd, F_GETFD);
        if (fl < 0 || fcntl(fd, F_SETFD, fl & ~FD_CLOEXEC) < 0)
            FAIL(SK_STEP_CLOSE_FDS, "pass-fd");
        keep[n++] = fd;
    }
    /* insertion sort: n is tiny */
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && keep[j - 1] > keep[j]; j--) {
            int t = keep[j];
            keep[j] = keep[j - 1];
            keep[j - 1] = t;
        }
    unsigned int lo = 3;
    for (size_t i = 0; i < n; i++) {
        unsigned int k = (unsigned int)keep[i];
        if (k > lo && syscall(SYS_close_range, lo, k - 1, 0) < 0)
            FAIL(SK_STEP_CLOSE_FDS, "close_range");
        if (k + 1 > lo)
            lo = k + 1;
    }
    if (syscall(SYS_close_range, lo, ~0U, 0) < 0)
        FAIL(SK_STEP_CLOSE_FDS, "close_range");
    return rep;
}

/* Wait on the sync pipe for the parent to release us into `stage`. EOF: the parent
 * went away (or could not finish its part): end quietly, it reports. Another
 * stage than the one we wait for: the two sides disagree; say so and end. */
static void await_stage(int sync_fd, int stage, int rep)
{
    unsigned char got;
    ssize_t n;
    do
        n = read(sync_fd, &got, 1);
    while (n < 0 && errno == EINTR);
    if (n != 1)
        _exit(125);
    if (got != stage) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_STAGE_ORDER, EPROTO, got, "sync pipe");
        _exit(125);
    }
}

static void parent_alive_or_exit(int sync_fd)
{
    struct pollfd pfd = {.fd = sync_fd, .events = POLLIN};
    if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLHUP | POLLERR)))
        _exit(125);
}

/* Everything after the mounts: identity, process state, confinement, init. */
static void __attribute__((noreturn)) child_rest(const struct sk_plan *p, int sync_fd, int rep)
{
    /* "": kept (--allow-degraded hostname, where sethostname is refused) */
    if (p->hostname && p->hostname[0] && sethostname(p->hostname, sk_strlen(p->hostname)) < 0)
        FAIL(SK_STEP_HOSTNAME, p->hostname);
    if (p->lo_up)
        lo_up(rep);

    /* Mounts ran with the cloning credentials (overlay records the mounter);
     * now become the sandbox user. Raw syscalls: glibc's set*id would signal
     * threads that exist only in the parent. */
    /* As a real root's sandbox of another user, host root is mapped too (plan.py
     * _mounter_id) and leaving uid 0 would clear the capabilities the steps up to
     * the caps step still need; that step drops them all and locks this bit. */
    if (p->drop_caps) {
        int sb = prctl(PR_GET_SECUREBITS, 0, 0, 0, 0);
        if (sb < 0 || prctl(PR_SET_SECUREBITS, (unsigned long)sb | SECBIT_NO_SETUID_FIXUP, 0, 0, 0) < 0)
            FAIL(SK_STEP_CAPS, "PR_SET_SECUREBITS");
    }
    if (p->drop_groups && syscall(SYS_setgroups, 0, NULL) < 0)
        FAIL(SK_STEP_SETGROUPS, NULL);
    if (syscall(SYS_setresgid, p->gid, p->gid, p->gid) < 0)
        FAIL(SK_STEP_SETGID, NULL);
    if (syscall(SYS_setresuid, p->uid, p->uid, p->uid) < 0)
        FAIL(SK_STEP_SETUID, NULL);
    /* A credential change clears the death signal: set it again, then make
     * sure the parent did not die in between. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        FAIL(SK_STEP_PDEATHSIG, NULL);
    parent_alive_or_exit(sync_fd);

    if (p->cwd && chdir(p->cwd) < 0)
        FAIL(SK_STEP_CHDIR, p->cwd);
    for (size_t i = 0; i < p->n_rlimits; i++) {
        struct rlimit rl = {.rlim_cur = p->rlimits[i].soft, .rlim_max = p->rlimits[i].hard};
        if (setrlimit(p->rlimits[i].resource, &rl) < 0)
            FAIL(SK_STEP_RLIMIT, NULL);
    }
    if (p->console_sock >= 0) {
        int s = sk_console_pty(p->console_sock, rep);
        int tty[3] = {s, s, s};
        setup_stdio(p, tty, rep);
    } else {
        setup_stdio(p, p->stdio, rep);
    }
    if (p->hold_before_exec)
        await_stage(sync_fd, SK_STAGE_ATTACHED, rep);
    rep = close_fds(p, rep);
    if (setsid() < 0)
        FAIL(SK_STEP_SETSID, NULL);
    if (p->drop_caps && sk_caps_child(p->keep_caps, rep) < 0)
        _exit(125);
    if (p->no_new_privs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        FAIL(SK_STEP_NO_NEW_PRIVS, NULL);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (p->landlock.abi > 0 && sk_landlock_child(&p->landlock, rep) < 0)
        _exit(125);
    if (p->seccomp_len && sk_seccomp_child(p->seccomp_bpf, p->seccomp_len, rep) < 0)
        _exit(125);
    /* After the policy filter: its denials win over a notification (the kernel takes
     * the most restrictive answer of all filters), so behaviour stays the policy's. */
    if (p->observe_sock >= 0 && sk_observe_child(p, rep) < 0)
        _exit(125);
    prctl(PR_SET_NAME, "stockade-init", 0, 0, 0);
    sk_init_child(p, rep);
}

/* The launcher keeps CAP_SYS_ADMIN in the new user namespace across its execve:
 * as a non-zero uid it would lose every capability, so make them ambient. */
static void __attribute__((noreturn)) exec_launcher(const struct sk_plan *p, int rep)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capget, &hdr, data) < 0)
        FAIL(SK_STEP_LAUNCHER, "capget");
    data[0].inheritable = data[0].permitted;
    data[1].inheritable = data[1].permitted;
    if (syscall(SYS_capset, &hdr, data) < 0)
        FAIL(SK_STEP_LAUNCHER, "capset");
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) < 0)
            break; /* past the kernel's last capability */
        /* a capability we lack is simply not raised; the mounts that need it then fail loudly */
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0);
    }
    char num[16];
    int k = 0, fd = p->launcher_ctl_fd;
    char rev[16];
    do {
        rev[k++] = (char)('0' + fd % 10);
        fd /= 10;
    } while (fd && k < 15);
    for (int i = 0; i < k; i++)
        num[i] = rev[k - 1 - i];
    num[k] = '\0';
    char *const argv[] = {"stockade-launcher", num, NULL};
    char *const envp[] = {NULL};
    syscall(SYS_execveat, p->launcher_exec_fd, "", argv, envp, AT_EMPTY_PATH);
    FAIL(SK_STEP_LAUNCHER, "execveat");
}

void sk_child_main(const struct sk_plan *p, int sync_fd, int rep, int procs_fd)
{
    reset_signals(); /* the mask stays full: init decides what it waits for */
    umask(022);
    /* A launcher outlives the thread that made it; it ends when its control
     * socket does (EOF), so no death signal for it. */
    if (p->launcher_exec_fd < 0 && prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        FAIL(SK_STEP_PDEATHSIG, NULL);
    await_stage(sync_fd, SK_STAGE_IDMAP, rep);
    if (p->launcher_exec_fd >= 0)
        exec_launcher(p, rep);
    if (procs_fd >= 0)
        sk_join_procs(procs_fd, rep); /* clone(2) fallback: no CLONE_INTO_CGROUP */
    if (p->n_cgroup_join_fds)
        sk_cgroup_join(p, rep);
    if (p->n_cgroup_join_fds || procs_fd >= 0) {
        /* the cgroup namespace was left for now: rooted at the run's cgroups */
        if ((p->clone_flags & CLONE_NEWCGROUP) && unshare(CLONE_NEWCGROUP) < 0)
            FAIL(SK_STEP_UNSHARE, "cgroup");
    }

    if (sk_mounts_child(p, rep) < 0)
        _exit(125);
    child_rest(p, sync_fd, rep);
}

/* In a launcher's run child: the launcher's staging tree (host at /oldroot, the
 * shared base at /newroot) is ours to finish in a private copy. */
void sk_run_child(const struct sk_plan *p, int sync_fd, int rep)
{
    int detached = 0;

    reset_signals();
    umask(022);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        FAIL(SK_STEP_PDEATHSIG, NULL);
    parent_alive_or_exit(sync_fd); /* no SK_STAGE_IDMAP: the launcher's maps were written once */
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
        FAIL(SK_STEP_MOUNT_PRIVATE, "/");
    if (chdir("/") < 0)
        FAIL(SK_STEP_STAGE, "/");
    if (sk_mounts_ops(p, rep, &detached) < 0 || sk_mounts_finish(rep, detached) < 0)
        _exit(125);
    child_rest(p, sync_fd, rep);
}
