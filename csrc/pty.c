/* pty.c: a pty of the sandbox's own devpts, for the sandbox's first command
 * (child.c) and for an exec's (init.c): one unit both call, so neither calls the other
 * for it. Async-signal-safe: no malloc, no stdio. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <termios.h>
#include <unistd.h>

#include "internal.h"

#define FAIL(step, path) \
    do { sk_report(rep, SK_REP_ERROR, (step), errno, 0, (path)); _exit(125); } while (0)

/* A pty from the sandbox's own devpts (so ttyname() works inside); the master
 * goes to the parent over the console socket, like runc's --console-socket. */
int sk_console_pty(int sock, int rep)
{
    int m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0)
        FAIL(SK_STEP_TTY, "/dev/pts/ptmx");
    int unlock = 0;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0)
        FAIL(SK_STEP_TTY, "TIOCSPTLCK");
    int s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0)
        FAIL(SK_STEP_TTY, "TIOCGPTPEER");
    if (sk_send_fd(sock, m, 'm') < 0)
        FAIL(SK_STEP_TTY, "console socket");
    close(m);
    close(sock);
    return s;
}
