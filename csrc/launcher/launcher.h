/* launcher.h: what the launcher's units share (the files of csrc/launcher; not the cffi API).
 *
 * main.c   the loop: the control socket, clients, requests (serve_one)
 * proto.c  messages: header, receiving one with its fds, the plan, replies
 * peer.c   who may ask: a shared launcher's clients and their HELLO
 * spare.c  the spare run child made ahead, and reaping
 * run.c    one run: C1 in its namespaces clones init (C2) and reports on it
 * state.c  the process's state (L) and the fds a run child must not keep
 */
#ifndef SK_LAUNCHER_H
#define SK_LAUNCHER_H

#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "../internal.h"

#define SK_MSG_MAGIC 0x324c4b53u /* "SKL2" */
#define SK_MSG_BASE 1
#define SK_MSG_RUN 2
#define SK_MSG_HELLO 3 /* a shared launcher's client, first: an fd of our user namespace */
#define SK_MSG_PLAN_IN_FD 1
#define MAX_FDS 250
#define INLINE_MAX (256 * 1024)
#define MAX_CLIENTS 64
#define SK_SO_PEERPIDFD 77 /* Linux 6.5 */

/* Every field has one meaning, in every message type (0 where it does not apply). */
struct sk_msg_hdr {
    uint32_t magic;
    uint32_t type;          /* SK_MSG_* */
    uint32_t flags;         /* SK_MSG_PLAN_IN_FD */
    uint32_t plan_len;      /* bytes of the plan part (wire.c) */
    uint32_t run_len;       /* bytes of the run part after it (RUN only) */
    uint32_t idle_seconds;  /* BASE of a shared launcher: exit after this long unused */
};

struct sk_launcher {
    int ctl;                    /* the owner's control socket, or -1 once it is gone */
    pid_t self_pid;
    int listen_fd;              /* shared mode: clients connect here */
    int clients[MAX_CLIENTS];
    int hello_done[MAX_CLIENTS]; /* the client proved it reaches our user namespace */
    int nclients;
    struct stat own_userns;     /* our user namespace (st_dev, st_ino) */
    long idle_ms;               /* shared mode: exit after this long unused */
    int sigfd;
    int live;                   /* forked children not yet reaped (runs, the spare) */
    pid_t spare_pid;
    int spare_sock;             /* to the spare run child, when there is one */
    unsigned long spare_flags;  /* the namespaces it made */
    unsigned long last_flags;
    int own_mntns;              /* our mount namespace: C1's way out of a run's */
};
extern struct sk_launcher L;

/* state.c */
void close_launcher_fds(void);

/* proto.c: msgbuf holds the last message received (header first). */
extern unsigned char msgbuf[INLINE_MAX + sizeof(struct sk_msg_hdr)];
const struct sk_msg_hdr *msg_hdr(void);
void close_all(const int *fds, int n);
ssize_t recv_msg(int sock, int *fds, int *nfds);
void send_report(int sock, int kind, int step, int err, int value, const char *path, int fd);
void send_report2(int sock, int kind, int step, int err, int value, const char *path, int fd, int fd2);
int read_plan(ssize_t n, int *fds, int *nfds, struct sk_plan *p, unsigned char **heap, int *hold);

/* peer.c */
void accept_client(void);
int check_hello(int sock);

/* run.c */
unsigned long run_ns_flags(const struct sk_plan *p);
void c1_start(void);
void run_in_ns(struct sk_plan *p, int *fds, int nfds, int unshare_err, int hold) __attribute__((noreturn));
void run_child(struct sk_plan *p, int *fds, int nfds, int hold) __attribute__((noreturn));

/* spare.c */
void make_spare(unsigned long flags);
int to_spare(ssize_t n, const int *fds, int nfds);
void reap_children(void);

#endif
