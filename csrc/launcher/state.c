/* state.c: the launcher's process-wide state, and the fds of it a run child drops. */
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

struct sk_launcher L = {
    .ctl = -1,
    .listen_fd = -1,
    .sigfd = -1,
    .spare_pid = -1,
    .spare_sock = -1,
    .last_flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID,
    .own_mntns = -1,
};

/* A run child keeps none of the launcher's sockets. */
void close_launcher_fds(void)
{
    if (L.ctl >= 0)
        close(L.ctl);
    if (L.listen_fd >= 0)
        close(L.listen_fd);
    for (int i = 0; i < L.nclients; i++)
        close(L.clients[i]);
    if (L.sigfd >= 0)
        close(L.sigfd);
    if (L.spare_sock >= 0)
        close(L.spare_sock);
    L.spare_sock = -1;
}
