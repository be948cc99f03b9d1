/* mounts.c: the op-list interpreter (bubblewrap's SetupOp, as data from the Plan).
 *
 * Staging: a tmpfs on plan->stage_dir becomes the root with the host's root
 * at /oldroot and the sandbox's root tmpfs at /newroot; ops refer to both by
 * literal paths. At the end /newroot becomes / and the host tree is detached.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

int sk_overlay_hold_fd = -1;

#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#define SK_MOUNT_ATTR_RDONLY 0x1
#define SK_MOUNT_ATTR_NOSUID 0x2
#define SK_MOUNT_ATTR_NODEV 0x4
#define SK_MOUNT_ATTR_NOEXEC 0x8

struct sk_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

static int set_attr(const char *target, uint64_t set, int recursive)
{
    struct sk_mount_attr a;
    memset(&a, 0, sizeof a);
    a.attr_set = set;
    return (int)syscall(SYS_mount_setattr, AT_FDCWD, target, recursive ? AT_RECURSIVE : 0, &a,
                        sizeof a);
}

/* mkdir -p of the first n bytes of path, with a stack buffer. */
static int mkpath_n(const char *path, size_t n, unsigned int mode)
{
    char buf[4096];
    if (n >= sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, path, n);
    buf[n] = '\0';
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == '\0') {
            char saved = buf[i];
            buf[i] = '\0';
            if (mkdir(buf, mode) < 0 && errno != EEXIST)
                return -1;
            buf[i] = saved;
        }
    }
    return 0;
}

static int mkpath(const char *path, unsigned int mode)
{
    return mkpath_n(path, sk_strlen(path), mode);
}

static int mkparent(const char *path)
{
    size_t n = sk_strlen(path);
    while (n > 0 && path[n] != '/')
        n--;
    return n == 0 ? 0 : mkpath_n(path, n, 0755);
}

static int ensure_file(const char *path)
{
    struct stat st;
    if (lstat(path, &st) == 0)
        return 0; /* never open an existing target: it may be a device or a /proc file */
    if (mkparent(path) < 0)
        return -1;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return errno == EEXIST ? 0 : -1;
    close(fd);
    return 0;
}

static int do_bind(const struct sk_mount_op *op)
{
    struct stat st;
    if (stat(op->source, &st) < 0) {
        if ((op->flags & SK_F_OPTIONAL) && (errno == ENOENT || errno == ENOTDIR))
            return 1; /* skipped */
        return -1;
    }
    int is_file = (op->flags & SK_F_FILE) || !S_ISDIR(st.st_mode);
    if ((is_file ? ensure_file(op->target) : mkpath(op->target, 0755)) < 0)
        return -1;
    unsigned long mf = MS_BIND | ((op->flags & SK_F_REC) ? MS_REC : 0);
    if (mount(op->source, op->target, NULL, mf, NULL) < 0)
        return -1;
    uint64_t set = SK_MOUNT_ATTR_NOSUID;
    if (!(op->flags & SK_F_DEV))
        set |= SK_MOUNT_ATTR_NODEV;
    if (op->flags & SK_F_RDONLY)
        set |= SK_MOUNT_ATTR_RDONLY;
    if (op->flags & SK_F_NOEXEC)
        set |= SK_MOUNT_ATTR_NOEXEC;
    return set_attr(op->target, set, 1);
}

static int write_all(int fd, const char *data, size_t len)
{
    while (len) {
        ssize_t w = write(fd, data, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        data += w;
        len -= (size_t)w;
    }
    return 0;
}

static int run_op(const struct sk_mount_op *op)
{
    unsigned long ro = (op->flags & SK_F_RDONLY) ? MS_RDONLY : 0;
    int fd;

    switch (op->kind) {
    case SK_OP_BIND:
        return do_bind(op);
    case SK_OP_TMPFS:
        if (mkpath(op->target, 0755) < 0)
            return -1;
        return mount("tmpfs", op->target, "tmpfs", MS_NOSUID | MS_NODEV | ro, op->data);
    case SK_OP_OVERLAY:
        if (mkpath(op->target, 0755) < 0)
            return -1;
        if (sk_overlay_hold_fd >= 0) {
            int r;
            while ((r = flock(sk_overlay_hold_fd, LOCK_EX)) < 0 && errno == EINTR)
                ;
            if (r < 0)
                return -1;
        }
        return mount("overlay", op->target, "overlay", MS_NOSUID | MS_NODEV | ro, op->data);
    case SK_OP_PROC:
        if (mkpath(op->target, 0555) < 0)
            return -1;
        return mount("proc", op->target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    case SK_OP_DEVPTS:
        if (mkpath(op->target, 0755) < 0)
            return -1;
        return mount("devpts", op->target, "devpts", MS_NOSUID | MS_NOEXEC, op->data);
    case SK_OP_MQUEUE:
        if (mkpath(op->target, 0755) < 0)
            return -1;
        return mount("mqueue", op->target, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    case SK_OP_MKDIR:
        if (mkpath(op->target, op->mode ? op->mode : 0755) < 0)
            return -1;
        return op->mode ? chmod(op->target, op->mode) : 0;
    case SK_OP_SYMLINK:
        if (mkparent(op->target) < 0)
            return -1;
        if (symlink(op->data, op->target) < 0 && errno != EEXIST)
            return -1;
        return 0;
    case SK_OP_FILE:
        if (mkparent(op->target) < 0)
            return -1;
        fd = open(op->target, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                  op->mode ? op->mode : 0644);
        if (fd < 0)
            return -1;
        if (write_all(fd, op->data, op->data_len) < 0) {
            int e = errno;
            close(fd);
            errno = e;
            return -1;
        }
        if (op->mode)
            fchmod(fd, op->mode);
        return close(fd);
    case SK_OP_DETACH_HOST:
        return umount2("/oldroot", MNT_DETACH);
    case SK_OP_REMOUNT_RO:
        return set_attr(op->target, SK_MOUNT_ATTR_RDONLY, (op->flags & SK_F_REC) != 0);
    default:
        errno = EINVAL;
        return -1;
    }
}

/* Staging: a tmpfs on the stage dir becomes the root, the host's root at
 * /oldroot, the sandbox's root tmpfs at /newroot. */
int sk_mounts_stage(const struct sk_plan *p, int rep)
{
    const char *stage = p->stage_dir ? p->stage_dir : "/tmp";

    /* Nothing we mount may propagate back to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_MOUNT_PRIVATE, errno, 0, "/");
        return -1;
    }
    if (mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k") < 0 ||
        chdir(stage) < 0 || mkdir("newroot", 0755) < 0 || mkdir("oldroot", 0755) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_STAGE, errno, 0, stage);
        return -1;
    }
    /* The source of masks bound after the host is detached. */
    int efd = open("empty", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0444);
    if (efd < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_STAGE, errno, 0, "empty");
        return -1;
    }
    close(efd);
    if (syscall(SYS_pivot_root, ".", "oldroot") < 0 || chdir("/") < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_PIVOT_ROOT, errno, 0, stage);
        return -1;
    }
    if (mount("tmpfs", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_STAGE, errno, 0, "/newroot");
        return -1;
    }
    return 0;
}

int sk_mounts_ops(const struct sk_plan *p, int rep, int *detached)
{
    for (size_t i = 0; i < p->n_ops; i++) {
        const struct sk_mount_op *op = &p->ops[i];
        if (run_op(op) < 0) {
            sk_report(rep, SK_REP_ERROR, SK_STEP_MOUNT, errno, (int)i, op->target);
            return -1;
        }
        if (op->kind == SK_OP_DETACH_HOST)
            *detached = 1;
    }
    return 0;
}

/* Detach the host, then make /newroot the root (runc's pivot_root(".", ".")). */
int sk_mounts_finish(int rep, int detached)
{
    if ((!detached && umount2("/oldroot", MNT_DETACH) < 0) || chdir("/newroot") < 0 ||
        syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_PIVOT_ROOT, errno, 0, "/newroot");
        return -1;
    }
    /* The binds were slaves of the host's mounts, so a mount the host made under
     * a read-only grant during the run (a writable one, say) would appear inside.
     * From here on the sandbox's tree is its own. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_MOUNT_PRIVATE, errno, 0, "/");
        return -1;
    }
    return 0;
}

int sk_mounts_child(const struct sk_plan *p, int rep)
{
    int detached = 0;
    if (sk_mounts_stage(p, rep) < 0 || sk_mounts_ops(p, rep, &detached) < 0)
        return -1;
    return sk_mounts_finish(rep, detached);
}
