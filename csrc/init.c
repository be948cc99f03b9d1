/* init.c: PID 1 of the sandbox. Forks the command, reaps every child, forwards
 * signals to the command's process group, reports the command's wait status
 * on the report pipe and exits with it (128+N for signal N). Exiting makes the
 * kernel kill everything else in the PID namespace, so nothing outlives a run.
 *
 * A living sandbox (plan->serve_fd >= 0) runs no command of its own: init serves
 * exec requests from its holder (stockade.live) over that socket, forking each
 * command already inside every namespace and confinement, so an exec costs a fork.
 * It ends when the holder's end closes (the kernel then kills the PID namespace).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "internal.h"

#define SK_MAX_ARGS 4096

static int path_exec(const char *path_env, const char *file, const char *const *argv, const char *const *envp)
{
    /* execvp's rules, without malloc: try each PATH entry; remember EACCES. */
    char buf[4096];
    const char *path = path_env && path_env[0] ? path_env : "/usr/local/bin:/usr/bin:/bin";
    size_t flen = sk_strlen(file);
    int seen_eacces = 0;
    const char *s = path;
    for (;;) {
        const char *e = s;
        while (*e && *e != ':')
            e++;
        size_t dlen = (size_t)(e - s);
        if (dlen == 0) { /* empty entry = current directory */
            buf[0] = '.';
            dlen = 1;
        } else if (dlen < sizeof buf) {
            memcpy(buf, s, dlen);
        }
        if (dlen + 1 + flen + 1 <= sizeof buf) {
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
            execve(buf, (char *const *)argv, (char *const *)envp);
            if (errno == EACCES)
                seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ESTALE && errno != ENODEV &&
                     errno != ETIMEDOUT)
                return errno;
        }
        if (!*e)
            break;
        s = e + 1;
    }
    return seen_eacces ? EACCES : ENOENT;
}

/* execve argv[0] as execvp would (PATH, a script without a shebang run by /bin/sh);
 * returns only on failure, with the errno to report. */
static int exec_command(const char *path_env, const char *const *argv, const char *const *envp)
{
    const char *file = argv[0];
    int err;
    int has_slash = 0;
    for (const char *c = file; *c; c++)
        if (*c == '/')
            has_slash = 1;
    if (has_slash) {
        execve(file, (char *const *)argv, (char *const *)envp);
        err = errno;
    } else {
        err = path_exec(path_env, file, argv, envp);
    }
    if (err == ENOEXEC) {
        /* A script without a shebang: run it with /bin/sh, as execvp does. */
        const char *argv2[SK_MAX_ARGS];
        size_t n = 0;
        argv2[n++] = "/bin/sh";
        argv2[n++] = file;
        for (size_t i = 1; argv[i] && n < SK_MAX_ARGS - 1; i++)
            argv2[n++] = argv[i];
        argv2[n] = NULL;
        execve("/bin/sh", (char *const *)argv2, (char *const *)envp);
        err = errno;
    }
    return err;
}

static void __attribute__((noreturn)) command_child(const struct sk_plan *p, int rep)
{
    sigset_t none;
    sigemptyset(&none);
    if (p->pty) {
        /* The command leads its own session with the pty as controlling tty. */
        if (setsid() < 0 || ioctl(0, TIOCSCTTY, 0) < 0) {
            sk_report(rep, SK_REP_ERROR, SK_STEP_TTY, errno, 0, "TIOCSCTTY");
            _exit(125);
        }
    } else {
        setpgid(0, 0);
    }
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* Observe mode: this child has its own copy of init's memory (see sk_init_child),
     * which init made non-dumpable; dumpable again, the supervisor may read the path of
     * the execve below (ptrace access), as it may every later one's (execve makes a
     * program dumpable). No process of the sandbox exists yet to read it first. */
    if (p->observe_sock >= 0)
        prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    int err = exec_command(p->path_env, p->argv, p->envp);
    sk_report(rep, SK_REP_EXEC_FAILED, SK_STEP_EXEC, err, 0, p->argv[0]);
    _exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
}

static void __attribute__((noreturn)) serve(int sock, int rep);

void sk_init_child(const struct sk_plan *p, int rep)
{
    if (p->serve_fd >= 0)
        serve(p->serve_fd, rep);
    static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};
    sigset_t waitset;
    sigemptyset(&waitset);
    sigaddset(&waitset, SIGCHLD);
    for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++)
        sigaddset(&waitset, forwarded[i]);
    /* Every signal is still blocked (since clone); we take them with sigwaitinfo. */

    /* vfork: we are a copy of the caller's (possibly large) address space, and
     * copying its page tables again would cost milliseconds. The command child
     * only makes async-signal-safe calls until execve or _exit. glibc's vfork
     * runs no atfork handlers. */
    /* Observe mode forks instead (a copy of the address space, without atfork
     * handlers): the child makes its own memory readable by the supervisor. */
    pid_t pid = p->observe_sock >= 0 ? (pid_t)syscall(SYS_clone, SIGCHLD, 0, NULL, NULL, 0) : vfork();
    if (pid == 0)
        command_child(p, rep);
    if (pid < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_FORK, errno, 0, NULL);
        _exit(125);
    }
    sk_report(rep, SK_REP_STARTED, 0, 0, (int)pid, NULL);
    /* init holds no stdio: output pipes close when the command's tree is gone. */
    close(0);
    close(1);
    close(2);

    for (;;) {
        siginfo_t si;
        int sig = sigwaitinfo(&waitset, &si);
        if (sig < 0)
            continue;
        if (sig == SIGCHLD) {
            int st;
            pid_t w;
            while ((w = waitpid(-1, &st, WNOHANG)) > 0) {
                if (w == (pid_t)pid) {
                    sk_report(rep, SK_REP_EXIT, 0, 0, st, NULL);
                    _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
                }
            }
            continue;
        }
        if (kill(-(pid_t)pid, sig) < 0)
            kill((pid_t)pid, sig);
    }
}

/* ---------------------------------------------------------------- a living sandbox
 *
 * init's loop: one poll over a signalfd (SIGCHLD), the holder's socket and each
 * running exec's socket. A request is checked, its command vforked (init waits
 * only until the child's execve), and reported on its exec socket; the holder
 * gets a note. Nothing here allocates: the strings go to one mapping made once.
 */

#define SK_MAX_EXECS 512

struct exec_slot {
    pid_t pid;        /* the command's pid inside; 0: free */
    int sock;         /* its exec socket; -1: the client is gone */
    unsigned int id;
};

static struct exec_slot slots[SK_MAX_EXECS];
static char *strings; /* SK_EXEC_MAX_STRINGS + 1 bytes, mapped once */

/* Notes the holder's socket had no room for, oldest first: sent when it has (POLLOUT).
 * init never blocks on its holder, and the holder never misses an exec's end (a lost
 * EXIT note would keep that exec "running" for good). */
#define SK_NOTE_BACKLOG 4096
static struct sk_note backlog[SK_NOTE_BACKLOG];
static unsigned int backlog_head, backlog_len;

static int send_note(int sock, const struct sk_note *n)
{
    return send(sock, n, sizeof *n, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof *n;
}

static void flush_notes(int sock)
{
    while (backlog_len) {
        if (!send_note(sock, &backlog[backlog_head]))
            return;
        backlog_head = (backlog_head + 1) % SK_NOTE_BACKLOG;
        backlog_len--;
    }
}

static void note(int sock, int kind, unsigned int id, int value, int err)
{
    struct sk_note n = {.kind = kind, .id = id, .value = value, .err = err};
    if (!backlog_len && send_note(sock, &n))
        return;
    if (backlog_len == SK_NOTE_BACKLOG) { /* the holder has not read for thousands of execs: drop the oldest */
        backlog_head = (backlog_head + 1) % SK_NOTE_BACKLOG;
        backlog_len--;
    }
    backlog[(backlog_head + backlog_len) % SK_NOTE_BACKLOG] = n;
    backlog_len++;
}

/* Close an exec socket with what its client sent still unread: the peer would get
 * ECONNRESET before the reports queued for it (a second signal sent as the command ended). */
static void close_exec_sock(int s)
{
    char junk[64];
    while (recv(s, junk, sizeof junk, MSG_DONTWAIT) > 0)
        ;
    close(s);
}

static void exec_report(int esock, int kind, int step, int err, int value, const char *path)
{
    struct sk_report r;
    sk_report_fill(&r, kind, step, err, value, path);
    send(esock, &r, sizeof r, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* The exec'd command, in the vfork child: it borrows init's memory until execve,
 * so it only makes system calls and writes its own stack. */
static void __attribute__((noreturn)) exec_child(const struct sk_exec_hdr *h, const char *const *argv,
                                                 const char *const *envp, const char *cwd, const char *path,
                                                 int esock, const int *fds, int nfds)
{
    sigset_t none;
    sigemptyset(&none);
    int floor = 2;
    for (unsigned int i = 0; i < h->nfds; i++)
        if (h->fd_targets[i] > floor)
            floor = h->fd_targets[i];
    /* Everything we need goes above the highest number asked for (close-on-exec),
     * so no source sits on a target; then each goes to its number. */
    int es = fcntl(esock, F_DUPFD_CLOEXEC, floor + 1);
    if (es < 0) { /* (a target at or above the sandbox's nofile limit) */
        exec_report(esock, SK_REP_ERROR, SK_STEP_CLOSE_FDS, errno, floor, "F_DUPFD");
        _exit(125);
    }
    int src[3 + SK_EXEC_MAX_FDS];
    int nsrc = nfds;
    for (int i = 0; i < nsrc; i++) {
        src[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, floor + 1);
        if (src[i] < 0) {
            exec_report(es, SK_REP_ERROR, SK_STEP_STDIO, errno, 0, "F_DUPFD");
            _exit(125);
        }
    }
    int std[3];
    int first_pass = 3;
    if (h->flags & SK_EXEC_F_PTY) {
        int t = sk_console_pty(src[0], es);
        std[0] = std[1] = std[2] = t;
        first_pass = 1;
    } else {
        std[0] = src[0];
        std[1] = src[1];
        std[2] = src[2];
    }
    /* every other fd of init's (its holder's socket, other execs' sockets): closed at exec */
    if (syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */) < 0) {
        for (int fd = 3; fd < 1024; fd++) {
            int fl = fcntl(fd, F_GETFD);
            if (fl >= 0)
                fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
        }
    }
    for (int i = 0; i < 3; i++)
        if (dup2(std[i], i) < 0) {
            exec_report(es, SK_REP_ERROR, SK_STEP_STDIO, errno, i, "dup2");
            _exit(125);
        }
    for (unsigned int i = 0; i < h->nfds; i++)
        if (dup2(src[first_pass + (int)i], h->fd_targets[i]) < 0) {
            exec_report(es, SK_REP_ERROR, SK_STEP_CLOSE_FDS, errno, h->fd_targets[i], "pass-fd");
            _exit(125);
        }
    if (h->flags & SK_EXEC_F_PTY) {
        if (setsid() < 0 || ioctl(0, TIOCSCTTY, 0) < 0) {
            exec_report(es, SK_REP_ERROR, SK_STEP_TTY, errno, 0, "TIOCSCTTY");
            _exit(125);
        }
    } else {
        setpgid(0, 0); /* its own group: signals and a hang-up reach its job, nothing else */
    }
    if (cwd[0] && chdir(cwd) < 0) {
        exec_report(es, SK_REP_ERROR, SK_STEP_CHDIR, errno, 0, cwd);
        _exit(125);
    }
    sigprocmask(SIG_SETMASK, &none, NULL);
    int err = exec_command(path, argv, envp);
    exec_report(es, SK_REP_EXEC_FAILED, SK_STEP_EXEC, err, 0, argv[0]);
    _exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
}

/* vfork in a frame of its own: nothing of the caller's lives across it */
static pid_t __attribute__((noinline)) start_command(const struct sk_exec_hdr *h, const char *const *argv,
                                                     const char *const *envp, const char *cwd, const char *path,
                                                     int esock, const int *fds, int nfds)
{
    pid_t pid = vfork();
    if (pid == 0)
        exec_child(h, argv, envp, cwd, path, esock, fds, nfds);
    return pid;
}

static void end_job(pid_t pid, int sig)
{
    if (kill(-pid, sig) < 0)
        kill(pid, sig);
}

static void close_all(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close_exec_sock(fds[i]); /* (a recv on what is not a socket just fails) */
}

static int find_free_slot(void)
{
    for (int i = 0; i < SK_MAX_EXECS; i++)
        if (slots[i].pid == 0)
            return i;
    return -1;
}

/* One request from the holder. Every fd it brought is closed here (the command
 * has its copies); the exec socket moves to a slot. */
static void take_request(int sock)
{
    struct sk_exec_hdr h;
    int fds[4 + SK_EXEC_MAX_FDS + 1];
    union {
        char buf[CMSG_SPACE(sizeof(int) * (4 + SK_EXEC_MAX_FDS + 1))];
        struct cmsghdr align;
    } u;
    struct iovec iov[2] = {{.iov_base = &h, .iov_len = sizeof h},
                           {.iov_base = strings, .iov_len = SK_EXEC_MAX_STRINGS}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n == 0)
        _exit(0); /* the holder is gone: so is the sandbox (PID namespace) */
    if (n < 0) {
        if (errno == EINTR || errno == EAGAIN)
            return;
        _exit(0);
    }
    int nf = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k && nf < (int)(sizeof fds / sizeof fds[0]); i++)
            memcpy(&fds[nf++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
    if ((size_t)n < sizeof h || h.magic != SK_SERVE_MAGIC || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        note(sock, SK_NOTE_FAILED, (size_t)n >= sizeof h ? h.id : 0, 0, EPROTO);
        close_all(fds, nf);
        return;
    }
    if (h.kind == SK_SERVE_SIGNAL_ALL) {
        close_all(fds, nf);
        if (h.sig > 0 && h.sig < 65)
            kill(-1, h.sig); /* every process of the namespace but init */
        return;
    }
    if (h.kind == SK_SERVE_SIGNAL) {
        close_all(fds, nf);
        for (int i = 0; i < SK_MAX_EXECS; i++)
            if (slots[i].pid && slots[i].id == h.id && h.sig > 0 && h.sig < 65)
                end_job(slots[i].pid, h.sig);
        return;
    }
    int stdn = (h.flags & SK_EXEC_F_PTY) ? 1 : 3;
    int want = 1 + stdn + (int)h.nfds + ((h.flags & SK_EXEC_F_MEMFD) ? 1 : 0);
    if (h.kind != SK_SERVE_EXEC || h.nfds > SK_EXEC_MAX_FDS || nf != want || h.argc == 0 ||
        h.argc + h.envc > SK_EXEC_MAX_STRINGS / 2) {
        if (nf > 0)
            exec_report(fds[0], SK_REP_ERROR, SK_STEP_EXEC, EPROTO, 0, "exec request");
        note(sock, SK_NOTE_FAILED, h.id, 0, EPROTO);
        close_all(fds, nf);
        return;
    }
    int esock = fds[0];
    size_t len = (size_t)n - sizeof h;
    if (h.flags & SK_EXEC_F_MEMFD) {
        int mfd = fds[nf - 1];
        len = 0;
        if (h.strings_len <= SK_EXEC_MAX_STRINGS) {
            while (len < h.strings_len) {
                ssize_t r = pread(mfd, strings + len, h.strings_len - len, (off_t)len);
                if (r <= 0)
                    break;
                len += (size_t)r;
            }
        }
        close(mfd);
        nf--;
    }
    if (len != h.strings_len) {
        exec_report(esock, SK_REP_ERROR, SK_STEP_EXEC, EPROTO, 0, "exec request");
        note(sock, SK_NOTE_FAILED, h.id, 0, EPROTO);
        close_all(fds, nf);
        return;
    }
    strings[len] = '\0';
    /* argv, env, cwd, PATH: pointers into the strings, on this stack (no malloc) */
    size_t count = (size_t)h.argc + h.envc + 2;
    size_t vec_bytes = (count + 2) * sizeof(char *);
    const char **vec = mmap(NULL, vec_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (vec == MAP_FAILED) {
        exec_report(esock, SK_REP_ERROR, SK_STEP_FORK, errno, 0, "mmap");
        note(sock, SK_NOTE_FAILED, h.id, 0, errno);
        close_all(fds, nf);
        return;
    }
    size_t off = 0, k = 0;
    while (k < count && off < len) {
        vec[k++] = strings + off;
        off += sk_strlen(strings + off) + 1;
    }
    if (k != count || off != len) {
        munmap(vec, vec_bytes);
        exec_report(esock, SK_REP_ERROR, SK_STEP_EXEC, EPROTO, 0, "exec request");
        note(sock, SK_NOTE_FAILED, h.id, 0, EPROTO);
        close_all(fds, nf);
        return;
    }
    /* argv[argc] = NULL, env after it: shift env up by one */
    const char *cwd = vec[h.argc + h.envc], *path = vec[h.argc + h.envc + 1];
    for (size_t i = h.argc + h.envc; i > h.argc; i--)
        vec[i] = vec[i - 1];
    vec[h.argc] = NULL;
    vec[h.argc + h.envc + 1] = NULL;
    const char *const *argv = vec;
    const char *const *envp = vec + h.argc + 1;

    int free_slot = find_free_slot();
    if (free_slot < 0) {
        munmap(vec, vec_bytes);
        exec_report(esock, SK_REP_ERROR, SK_STEP_FORK, EAGAIN, 0, "too many commands at once");
        note(sock, SK_NOTE_FAILED, h.id, 0, EAGAIN);
        close_all(fds, nf);
        return;
    }
    pid_t pid = start_command(&h, argv, envp, cwd, path, esock, fds + 1, nf - 1);
    int e = errno;
    munmap(vec, vec_bytes);
    close_all(fds + 1, nf - 1);
    if (pid < 0) {
        exec_report(esock, SK_REP_ERROR, SK_STEP_FORK, e, 0, NULL);
        note(sock, SK_NOTE_FAILED, h.id, 0, e);
        close_exec_sock(esock);
        return;
    }
    slots[free_slot].pid = pid;
    slots[free_slot].sock = esock;
    slots[free_slot].id = h.id;
    exec_report(esock, SK_REP_STARTED, 0, 0, (int)pid, NULL);
    note(sock, SK_NOTE_STARTED, h.id, (int)pid, 0);
}

/* The exec socket is readable: a signal for the command, or its client is gone. */
static void take_signal(struct exec_slot *s)
{
    struct sk_exec_signal m;
    ssize_t n = recv(s->sock, &m, sizeof m, MSG_DONTWAIT);
    if (n == (ssize_t)sizeof m) {
        if (m.sig > 0 && m.sig < 65)
            end_job(s->pid, m.sig);
        return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    /* EOF or an error: nobody waits for this command any more; it ends, alone */
    end_job(s->pid, SIGKILL);
    close_exec_sock(s->sock);
    s->sock = -1;
}

static void reap(int sock)
{
    int st;
    pid_t w;
    while ((w = waitpid(-1, &st, WNOHANG)) > 0) {
        for (int i = 0; i < SK_MAX_EXECS; i++) {
            if (slots[i].pid != w)
                continue;
            if (slots[i].sock >= 0) {
                exec_report(slots[i].sock, SK_REP_EXIT, 0, 0, st, NULL);
                close_exec_sock(slots[i].sock);
            }
            note(sock, SK_NOTE_EXIT, slots[i].id, st, 0);
            slots[i].pid = 0;
            slots[i].sock = -1;
            break;
        }
        /* anything else: an orphan of an earlier command, reparented to us */
    }
}

static void __attribute__((noreturn)) serve(int sock, int rep)
{
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    strings = mmap(NULL, SK_EXEC_MAX_STRINGS + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (sfd < 0 || strings == MAP_FAILED) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_FORK, errno, 0, sfd < 0 ? "signalfd" : "mmap");
        _exit(125);
    }
    int fl = fcntl(sock, F_GETFD);
    if (fl >= 0)
        fcntl(sock, F_SETFD, fl | FD_CLOEXEC);
    for (int i = 0; i < SK_MAX_EXECS; i++)
        slots[i].sock = -1;
    sk_report(rep, SK_REP_STARTED, 0, 0, (int)getpid(), NULL);
    close(rep);
    close(0);
    close(1);
    close(2);
    note(sock, SK_NOTE_READY, 0, (int)getpid(), 0);

    static struct pollfd pf[2 + SK_MAX_EXECS];
    static int which[2 + SK_MAX_EXECS];
    for (;;) {
        int n = 0;
        pf[n].fd = sfd;
        pf[n].events = POLLIN;
        which[n++] = -1;
        pf[n].fd = sock;
        pf[n].events = POLLIN | (backlog_len ? POLLOUT : 0);
        which[n++] = -2;
        for (int i = 0; i < SK_MAX_EXECS; i++)
            if (slots[i].pid && slots[i].sock >= 0) {
                pf[n].fd = slots[i].sock;
                pf[n].events = POLLIN;
                which[n++] = i;
            }
        int r = poll(pf, (nfds_t)n, -1);
        if (r < 0)
            continue;
        for (int j = 0; j < n; j++) {
            if (!pf[j].revents)
                continue;
            if (which[j] == -1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0)
                    ;
                reap(sock);
            } else if (which[j] == -2) {
                if (pf[j].revents & (POLLHUP | POLLERR) && !(pf[j].revents & POLLIN))
                    _exit(0); /* the holder is gone */
                if (pf[j].revents & POLLOUT)
                    flush_notes(sock);
                if (pf[j].revents & POLLIN)
                    take_request(sock);
            } else {
                struct exec_slot *s = &slots[which[j]];
                if (s->pid && s->sock == pf[j].fd)
                    take_signal(s);
            }
        }
    }
}
