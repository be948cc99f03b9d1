/* stockade_native.h: the only C API of the native core.
 *
 * Parsed verbatim by cffi's cdef, so: no #include, no #if, no expressions in
 * #define. The Python side (src/stockade/linux/native.py) lowers a Plan into
 * these structs; everything the child needs is prepared by the parent before
 * clone, because between clone and execve the child may only make
 * async-signal-safe calls (no malloc, no stdio, no Python).
 */

/* Mount op kinds, executed in order by one loop (mounts.c). Paths are literal
 * in the child's staging namespace: sources under /oldroot, targets under
 * /newroot (the Python side adds the prefixes). */
#define SK_OP_BIND 1        /* bind source on target (mkdir/creat target) */
#define SK_OP_TMPFS 2       /* tmpfs on target, data = options */
#define SK_OP_OVERLAY 3     /* overlayfs on target, data = full option string */
#define SK_OP_PROC 4        /* new procfs on target */
#define SK_OP_DEVPTS 5      /* new devpts instance on target, data = options */
#define SK_OP_MKDIR 6       /* mkdir -p target, mode */
#define SK_OP_SYMLINK 7     /* symlink data -> target */
#define SK_OP_FILE 8        /* create target with data (data_len bytes), mode */
#define SK_OP_REMOUNT_RO 9  /* make target read-only (recursive with SK_F_REC) */
#define SK_OP_MQUEUE 10     /* new mqueue on target */
#define SK_OP_DETACH_HOST 11 /* detach /oldroot: later ops cannot reach the host; the
                                staging tmpfs keeps /empty, an empty read-only file */

#define SK_F_RDONLY 1       /* bind/tmpfs: read-only */
#define SK_F_REC 2          /* bind: recursive; remount: recursive */
#define SK_F_OPTIONAL 4     /* skip silently when the source is missing */
#define SK_F_DEV 8          /* keep device nodes usable (no nodev) */
#define SK_F_FILE 16        /* the target is a file, not a directory */
#define SK_F_NOEXEC 32      /* mount noexec */

struct sk_mount_op {
    int kind;
    unsigned int flags;
    const char *source;
    const char *target;
    const char *data;
    size_t data_len;
    unsigned int mode;
};

struct sk_rlimit {
    int resource;
    unsigned long long soft;
    unsigned long long hard;
};

struct sk_landlock_rule {
    const char *path;
    unsigned long long access;
    int optional;
};

struct sk_landlock {
    int abi;                          /* 0 = do not apply Landlock */
    unsigned long long handled_fs;
    unsigned long long handled_net;   /* ABI >= 4 */
    unsigned long long scoped;        /* ABI >= 6 */
    const struct sk_landlock_rule *rules;
    size_t n_rules;
    const unsigned short *bind_ports;    /* allowed TCP bind ports */
    size_t n_bind_ports;
    const unsigned short *connect_ports; /* allowed TCP connect ports */
    size_t n_connect_ports;
    unsigned int restrict_flags;      /* landlock_restrict_self's flags (ABI >= 7): observe mode's
                                         LOG_NEW_EXEC_ON, so denials after init's execve of the
                                         command reach the kernel audit stream; else 0 */
};

/* The fields marked "run" are what differs between runs of one prepared plan: a
 * struct sk_run carries them, packed apart from the rest (wire.c), and
 * sk_run_apply puts them in the plan, for a cold start and a launcher alike. */
struct sk_plan {
    unsigned long long clone_flags;   /* CLONE_NEW* */
    int cgroup_fd;                    /* run: >= 0: CLONE_INTO_CGROUP */
    const int *cgroup_join_fds;       /* run: cgroup v1: the run's `tasks` files; the child
                                         writes "0" to each first (a task moving itself
                                         skips the RCU grace period a move of another
                                         process waits for), before its cgroup namespace */
    size_t n_cgroup_join_fds;

    const char *uid_map;              /* written by the parent */
    const char *gid_map;
    int deny_setgroups;               /* write "deny" to /proc/PID/setgroups first */
    int drop_groups;                  /* child: setgroups(0, NULL) */
    unsigned int uid;                 /* ids inside the sandbox the command runs as */
    unsigned int gid;

    const char *stage_dir;            /* where the staging tmpfs goes, e.g. "/tmp" */
    const struct sk_mount_op *ops;
    size_t n_ops;

    const char *hostname;
    int lo_up;
    const char *cwd;                  /* run */

    const struct sk_rlimit *rlimits;
    size_t n_rlimits;

    int stdio[3];                     /* run: fds dup'ed onto 0, 1, 2 (-1: inherit) */
    const int *keep_fds;              /* passed through at the same number */
    size_t n_keep_fds;
    const int *keep_src;              /* NULL: keep_fds[i] is this process's fd of that
                                         number; else keep_src[i] goes to keep_fds[i] */
    int pty;                          /* run: make stdin (a pty) the command's controlling tty */
    int console_sock;                 /* run: >= 0: open a pty in the sandbox's devpts, use it as
                                         stdio and send its master over this socket */

    int drop_caps;
    unsigned long long keep_caps;     /* with drop_caps: the capabilities root inside keeps
                                         in its own user namespace (a mapped id range) */
    int no_new_privs;
    struct sk_landlock landlock;
    const unsigned char *seccomp_bpf; /* struct sock_filter[], installed last */
    size_t seccomp_len;

    /* Set from a struct sk_run (sk_run_apply): */
    const char *const *argv;
    const char *const *envp;
    const char *path_env;             /* PATH used to find argv[0] */
    int hold_before_exec;             /* wait for SK_STAGE_ATTACHED before running anything
                                         of the command's: the parent attaches cgroups
                                         (slow on v1) while the child builds its mounts */

    int serve_fd;                     /* run: >= 0: a living sandbox: init runs no argv but serves
                                         exec requests on this SOCK_SEQPACKET socket (init.c) */

    int launcher_exec_fd;             /* >= 0: at SK_STAGE_IDMAP, exec this launcher binary
                                         (with launcher_ctl_fd) instead of building the sandbox */
    int launcher_ctl_fd;

    int observe_sock;                 /* run: >= 0: observe mode (observe.c): after the policy
                                         filter, init installs observe_bpf (SECCOMP_RET_USER_NOTIF)
                                         with a new listener and sends it over this socket */
    const unsigned char *observe_bpf; /* run: struct sock_filter[]; a k of SK_OBSERVE_SOCK_K is
                                         replaced by observe_sock's number (init's own handoff) */
    size_t observe_len;
};

/* The data of ops[op], an SK_OP_OVERLAY: its layers differ from session to session. */
struct sk_overlay_data {
    size_t op;
    const char *data;
};

struct sk_run {
    const char *const *argv;
    const char *const *envp;
    const char *path_env;
    const char *cwd;
    const struct sk_overlay_data *overlays;
    size_t n_overlays;
    int stdio[3];
    int cgroup_fd;
    const int *cgroup_join_fds;
    size_t n_cgroup_join_fds;
    int pty;
    int console_sock;
    int hold_before_exec;
    int serve_fd;
    int hold_fd;                      /* launcher: the fd slot of the session's overlay lock
                                         (see csrc/launcher/main.c), or -1; not a plan field */
    int observe_sock;
    const unsigned char *observe_bpf;
    size_t observe_len;
};

/* Handshake: the parent releases its child one stage at a time, writing the stage's
 * number (one byte) on the sync pipe; the child reads each and checks it is the one
 * it waits for (runc's nsexec.c sync_t). A cold start's child (and a launcher's)
 * waits for SK_STAGE_IDMAP; a child with hold_before_exec then for SK_STAGE_ATTACHED.
 * A launcher's run child has no id maps of its own to wait for. */
enum sk_stage {
    SK_STAGE_IDMAP = 1,     /* its uid/gid maps are written: it may become its ids */
    SK_STAGE_ATTACHED = 2   /* it is in the run's cgroups: it may start the command */
};

/* Report records on the CLOEXEC report pipe, child -> parent. */
#define SK_REP_ERROR 1        /* a setup step failed: step, err, path, value = op index */
#define SK_REP_STARTED 2      /* init forked the command: value = its pid inside */
#define SK_REP_EXEC_FAILED 3  /* execve failed: err, path */
#define SK_REP_EXIT 4         /* the command ended: value = wait status */
#define SK_REP_INIT 5         /* launcher: the sandbox's init exists: value = its pid,
                                 its pidfd rides along (SCM_RIGHTS) */
#define SK_REP_INIT_EXIT 6    /* launcher: init was reaped: value = its wait status */
#define SK_REP_READY 7        /* launcher: the shared base tree is built */

#define SK_STEP_SYNC 1
#define SK_STEP_PDEATHSIG 2
#define SK_STEP_MOUNT_PRIVATE 3
#define SK_STEP_STAGE 4
#define SK_STEP_MOUNT 5
#define SK_STEP_PIVOT_ROOT 6
#define SK_STEP_HOSTNAME 7
#define SK_STEP_LO_UP 8
#define SK_STEP_SETGROUPS 9
#define SK_STEP_SETGID 10
#define SK_STEP_SETUID 11
#define SK_STEP_CHDIR 12
#define SK_STEP_RLIMIT 13
#define SK_STEP_STDIO 14
#define SK_STEP_CLOSE_FDS 15
#define SK_STEP_SETSID 16
#define SK_STEP_CAPS 17
#define SK_STEP_NO_NEW_PRIVS 18
#define SK_STEP_LANDLOCK 19
#define SK_STEP_SECCOMP 20
#define SK_STEP_FORK 21
#define SK_STEP_EXEC 22
#define SK_STEP_TTY 23
#define SK_STEP_CLONE 24
#define SK_STEP_UID_MAP 25
#define SK_STEP_GID_MAP 26
#define SK_STEP_SETGROUPS_FILE 27
#define SK_STEP_PIPE 28
#define SK_STEP_LAUNCHER 29
#define SK_STEP_UNSHARE 30
#define SK_STEP_CGROUP_JOIN 31 /* value = index into cgroup_join_fds */
#define SK_STEP_STAGE_ORDER 32 /* the sync pipe brought another stage: value = it, err = EPROTO */
#define SK_STEP_OBSERVE 33     /* observe mode: its filter, its listener's handoff */

/* A living sandbox (plan->serve_fd): the holder's requests to init, one SOCK_SEQPACKET
 * message each: this header, then strings_len bytes of NUL-terminated strings (argc
 * argv strings, envc env strings, the cwd, PATH), inline or (SK_EXEC_F_MEMFD) in a
 * memfd sent last. fds (SCM_RIGHTS), in order: the exec socket, then stdin, stdout,
 * stderr (or, with SK_EXEC_F_PTY, a console socket), then nfds passed fds, each to
 * fd_targets[i] in the command. init reports on the exec socket (struct sk_report:
 * SK_REP_STARTED, SK_REP_ERROR, SK_REP_EXEC_FAILED, SK_REP_EXIT) and takes a struct
 * sk_exec_signal from it; its hang-up kills the command's process group. */
#define SK_SERVE_MAGIC 1936418405
#define SK_SERVE_EXEC 1         /* run a command */
#define SK_SERVE_SIGNAL_ALL 2   /* kill(-1, sig): every process of the sandbox but init */
#define SK_SERVE_SIGNAL 3       /* sig to the process group of the exec numbered id */
#define SK_EXEC_F_PTY 1         /* the command's stdio is a pty of the sandbox's devpts */
#define SK_EXEC_F_MEMFD 2       /* the strings are in a memfd, the last fd */
#define SK_EXEC_MAX_FDS 64
#define SK_EXEC_MAX_STRINGS 4194304

struct sk_exec_hdr {
    unsigned int magic;
    unsigned int kind;
    unsigned int id;                  /* the holder's number for this exec */
    unsigned int flags;
    int sig;                          /* SK_SERVE_SIGNAL_ALL, SK_SERVE_SIGNAL */
    unsigned int argc;
    unsigned int envc;
    unsigned int nfds;                /* passed fds after stdio */
    unsigned int strings_len;
    int fd_targets[64];
};

struct sk_exec_signal {
    int sig;
};

/* init -> holder on the serve socket, never blocking (a holder that stopped reading
 * loses notes, never stalls init). */
#define SK_NOTE_STARTED 1       /* value = the command's pid inside */
#define SK_NOTE_EXIT 2          /* value = its wait status */
#define SK_NOTE_FAILED 3        /* err = why the request could not start */
#define SK_NOTE_READY 4         /* init serves */

struct sk_note {
    int kind;
    unsigned int id;
    int value;
    int err;
};

struct sk_report {
    int kind;
    int step;
    int err;
    int value;
    char path[240];
};

struct sk_child {
    int pid;        /* host pid of the sandbox's init */
    int pidfd;
    int report_fd;  /* read end of the report pipe */
    int sync_fd;    /* write end of the sync pipe; keep open while the sandbox runs */
};

/* Clone the child into new namespaces and write its id maps (unless a helper
 * must: plan->uid_map NULL). The child waits for SK_STAGE_IDMAP. Returns 0 or
 * -errno; on failure *step names what failed. */
int sk_spawn(const struct sk_plan *plan, struct sk_child *out, int *step);

/* Release the child into the next stage (enum sk_stage). Returns 0 or -errno. */
int sk_release(int sync_fd, int stage);

/* Put a run's fields in the plan (its overlay ops' data included). 0, or -EINVAL
 * when an overlay index names no SK_OP_OVERLAY op. */
int sk_run_apply(struct sk_plan *plan, const struct sk_run *run);

/* Flatten a plan (without its run fields) or a run for the launcher process:
 * return the size; write only when it fits in cap (NULL, 0 sizes the buffer). */
size_t sk_plan_pack(const struct sk_plan *plan, unsigned char *buf, size_t cap);
size_t sk_run_pack(const struct sk_run *run, unsigned char *buf, size_t cap);

/* Landlock ABI version of the running kernel: >= 1, or -errno. */
int sk_landlock_abi(void);

/* Can a sandbox build this wall here? In a throwaway child with a new user
 * namespace (and mount+PID, or UTS, namespaces): mount a new procfs
 * (SK_PROBE_PROC), or set a hostname (SK_PROBE_HOSTNAME). 0: it can; > 0: the
 * errno the kernel (or a seccomp filter) gave; < 0: -errno of the clone itself. */
#define SK_PROBE_PROC 1
#define SK_PROBE_HOSTNAME 2
int sk_probe(int what);

/* Observe mode (observe.c): the supervisor's side of the seccomp user notification
 * listener. One record per notified syscall (struct sk_obs_rec, then data_len bytes:
 * the path, or the sockaddr) is handed over in memory (sk_observe_take); every
 * notification is answered with SECCOMP_USER_NOTIF_FLAG_CONTINUE, so the command's
 * behaviour is unchanged. Opens resolved beneath skip_prefix (the project) are
 * answered but not recorded, unless beneath one of the n_watch paths (the project's
 * masked secrets). The thread runs until the listener hangs up (no task left in the
 * filter) or stop_fd is readable. */
#define SK_OBSERVE_SOCK_K 1935831925   /* 0x7362736f: placeholder k in the observe BPF */
#define SK_OBSERVE_HANDOFF_FLAGS 1073758208 /* 0x40004000, MSG_NOSIGNAL|MSG_CMSG_CLOEXEC: init's
                                               handoff of the listener, the one sendmsg the observe
                                               filter lets through (with its socket's number) */
#define SK_OBS_EXEC 1
#define SK_OBS_OPEN 2
#define SK_OBS_CONNECT 3
#define SK_OBS_SENDTO 4
#define SK_OBS_SENDMSG 5
#define SK_OBS_F_UNREADABLE 1   /* the argument could not be read: err says why */
#define SK_OBS_F_TRUNCATED 2    /* the path was longer than the buffer */
#define SK_OBS_F_RELATIVE 4     /* a relative path whose directory could not be resolved */

struct sk_obs_rec {
    unsigned int len;           /* the whole record, header included */
    unsigned short kind;        /* SK_OBS_* */
    unsigned short flags;       /* SK_OBS_F_* */
    int pid;                    /* host pid */
    int nr;                     /* syscall number */
    int err;
    unsigned int data_len;
    unsigned long long arg;     /* open: flags; exec: execveat flags */
};

struct sk_observe_stats {
    unsigned long long notified;
    unsigned long long logged;
    unsigned long long skipped;     /* inside skip_prefix */
    unsigned long long stale;       /* the target died or the call was interrupted first */
    unsigned long long unreadable;
    unsigned long long lost;        /* records dropped: the supervisor left 64 MiB untaken */
    unsigned int handover;          /* SK_OBS_SAME_CPU | SK_OBS_IN_RECEIVE: how the loop ran */
};
#define SK_OBS_SAME_CPU 1   /* the kernel's synchronous hand-over (Linux 6.6+) */
#define SK_OBS_IN_RECEIVE 2 /* waited in the receive, no poll per call (Linux 6.11+) */

/* Take the listener init sends over sock, then answer every notification, in a thread
 * of its own (strings copied; fds borrowed until the join) that never needs the GIL and
 * wakes nobody: the supervisor takes the records on its own time. poll_first: poll
 * before each receive even where the receive alone would do (Linux 6.11+). NULL and
 * errno on failure. */
void *sk_observe_spawn(int sock, int stop_fd, int poll_first, const char *skip_prefix, const char *const *watch,
                       size_t n_watch);
/* The records handed over since the last take: their length, and *data (NULL when
 * none; the caller frees it with sk_observe_free). Whole records only. */
size_t sk_observe_take(void *handle, unsigned char **data);
void sk_observe_free(void *data);
/* Wait for the thread up to timeout_ms (-1: no limit): 0 with *st and *result (0,
 * -errno, or -ENOMSG when no listener came), or -ETIMEDOUT. */
int sk_observe_join(void *handle, int timeout_ms, struct sk_observe_stats *st, int *result);
/* Free a joined handle (its untaken records with it). */
void sk_observe_release(void *handle);
