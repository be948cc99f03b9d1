/* spawn.c: a cold start. Clone the child into new namespaces (child.c runs it),
 * write its id maps, release it stage by stage; and sk_probe, the same clone in a
 * throwaway child.
 *
 * Runs in the caller's thread, which may be one of many.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"

static int write_proc(int pid, const char *file, const char *data)
{
    char path[64];
    int len = 0;
    /* tiny itoa: the parent may use snprintf, but keep one style */
    char num[16];
    int k = 0;
    do {
        num[k++] = (char)('0' + pid % 10);
        pid /= 10;
    } while (pid);
    memcpy(path, "/proc/", 6);
    len = 6;
    while (k)
        path[len++] = num[--k];
    path[len++] = '/';
    size_t fl = sk_strlen(file);
    memcpy(path + len, file, fl + 1);

    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    size_t dl = sk_strlen(data);
    ssize_t w = write(fd, data, dl);
    int e = (w < 0) ? errno : ((size_t)w != dl ? EIO : 0);
    close(fd);
    return -e;
}

int sk_spawn(const struct sk_plan *p, struct sk_child *out, int *step)
{
    int syncp[2], repp[2];
    sigset_t all, old;

    if (pipe2(syncp, O_CLOEXEC) < 0) {
        *step = SK_STEP_PIPE;
        return -errno;
    }
    if (pipe2(repp, O_CLOEXEC) < 0) {
        int e = errno;
        close(syncp[0]);
        close(syncp[1]);
        *step = SK_STEP_PIPE;
        return -e;
    }

    /* With 0..2 closed by the caller, a pipe end could land there and be clobbered
     * by the child's stdio setup: keep them all at 3 or above. */
    int *ends[4] = {&syncp[0], &syncp[1], &repp[0], &repp[1]};
    for (int i = 0; i < 4; i++) {
        if (*ends[i] < 3) {
            int fd = fcntl(*ends[i], F_DUPFD_CLOEXEC, 3);
            if (fd < 0) {
                int e = errno;
                close(syncp[0]);
                close(syncp[1]);
                close(repp[0]);
                close(repp[1]);
                *step = SK_STEP_PIPE;
                return -e;
            }
            close(*ends[i]);
            *ends[i] = fd;
        }
    }

    struct sk_clone_args ca;
    int pidfd = -1;
    memset(&ca, 0, sizeof ca);
    ca.flags = p->clone_flags | CLONE_PIDFD;
    if (p->n_cgroup_join_fds)
        ca.flags &= ~(unsigned long long)CLONE_NEWCGROUP; /* the child joins its cgroups first */
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    if (p->cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)p->cgroup_fd;
    }

    /* No signal handler of the caller may run in the child. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int procs_fd;
    long pid = sk_clone(&ca, &procs_fd);
    if (pid == 0) {
        close(syncp[1]);
        close(repp[0]);
        sk_child_main(p, syncp[0], repp[1], procs_fd);
    }
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (procs_fd >= 0)
        close(procs_fd);
    close(syncp[0]);
    close(repp[1]);
    if (pid < 0) {
        close(syncp[1]);
        close(repp[0]);
        *step = SK_STEP_CLONE;
        return -e;
    }

    int r = 0;
    if (p->deny_setgroups && (r = write_proc((int)pid, "setgroups", "deny")) < 0)
        *step = SK_STEP_SETGROUPS_FILE;
    else if (p->uid_map && (r = write_proc((int)pid, "uid_map", p->uid_map)) < 0)
        *step = SK_STEP_UID_MAP;
    else if (p->gid_map && (r = write_proc((int)pid, "gid_map", p->gid_map)) < 0)
        *step = SK_STEP_GID_MAP;
    if (r < 0) {
        kill((pid_t)pid, SIGKILL);
        waitid(P_PIDFD, (id_t)pidfd, NULL, WEXITED);
        close(pidfd);
        close(syncp[1]);
        close(repp[0]);
        return r;
    }
    out->pid = (int)pid;
    out->pidfd = pidfd;
    out->report_fd = repp[0];
    out->sync_fd = syncp[1];
    return 0;
}

int sk_probe(int what)
{
    struct sk_clone_args ca;
    sigset_t all, old;
    int procs_fd, status;
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_NEWUSER | (what == SK_PROBE_PROC ? CLONE_NEWNS | CLONE_NEWPID : CLONE_NEWUTS);
    ca.exit_signal = 0; /* no SIGCHLD for the caller's handlers: reaped with __WALL */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = sk_clone(&ca, &procs_fd);
    if (pid == 0) {
        /* The same calls the sandbox makes: root in the new user namespace, no maps needed. */
        int r;
        if (what == SK_PROBE_PROC)
            r = mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 ? errno : 0;
        else
            r = sethostname("stockade", 8) < 0 ? errno : 0;
        _exit(r & 0xff);
    }
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0)
        return -e;
    while (waitpid((pid_t)pid, &status, __WALL) < 0)
        if (errno != EINTR)
            return -errno;
    return WIFEXITED(status) ? WEXITSTATUS(status) : EIO;
}

int sk_release(int sync_fd, int stage)
{
    unsigned char b = (unsigned char)stage;
    ssize_t n;
    do
        n = write(sync_fd, &b, 1);
    while (n < 0 && errno == EINTR);
    return n == 1 ? 0 : -errno;
}
