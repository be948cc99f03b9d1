/* init.c: PID 1 of the sandbox. Forks the command, reaps every child, forwards
 * signals to the command's process group, reports the command's wait status
 * on the report pipe and exits with it (128+N for signal N). Exiting makes the
 * kernel kill everything else in the PID namespace, so nothing outlives a run.
 *
 * Warm sessions: the loop is a sigwaitinfo dispatcher; a later change can add
 * a control fd (signalfd + poll) over which the parent asks for more commands.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "internal.h"

#define SK_MAX_ARGS 4096

static int path_exec(const struct sk_plan *p, const char *file)
{
    /* execvp's rules, without malloc: try each PATH entry; remember EACCES. */
    char buf[4096];
    const char *path = p->path_env ? p->path_env : "/usr/local/bin:/usr/bin:/bin";
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
            execve(buf, (char *const *)p->argv, (char *const *)p->envp);
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

    const char *file = p->argv[0];
    int err;
    int has_slash = 0;
    for (const char *c = file; *c; c++)
        if (*c == '/')
            has_slash = 1;
    if (has_slash) {
        execve(file, (char *const *)p->argv, (char *const *)p->envp);
        err = errno;
    } else {
        err = path_exec(p, file);
    }
    if (err == ENOEXEC) {
        /* A script without a shebang: run it with /bin/sh, as execvp does. */
        const char *argv2[SK_MAX_ARGS];
        size_t n = 0;
        argv2[n++] = "/bin/sh";
        argv2[n++] = file;
        for (size_t i = 1; p->argv[i] && n < SK_MAX_ARGS - 1; i++)
            argv2[n++] = p->argv[i];
        argv2[n] = NULL;
        execve("/bin/sh", (char *const *)argv2, (char *const *)p->envp);
        err = errno;
    }
    sk_report(rep, SK_REP_EXEC_FAILED, SK_STEP_EXEC, err, 0, file);
    _exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
}

void sk_init_child(const struct sk_plan *p, int rep)
{
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
    pid_t pid = vfork();
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
