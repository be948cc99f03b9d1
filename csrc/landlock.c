/* landlock.c: ABI probe and ruleset create/add/restrict (child side). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

/* Own definitions: the build host's headers may predate the ABI we handle. */
#define SK_NR_landlock_create_ruleset 444
#define SK_NR_landlock_add_rule 445
#define SK_NR_landlock_restrict_self 446
#define SK_LL_CREATE_RULESET_VERSION 1U
#define SK_LL_RULE_PATH_BENEATH 1
#define SK_LL_RULE_NET_PORT 2
#define SK_LL_NET_BIND_TCP 1ULL
#define SK_LL_NET_CONNECT_TCP 2ULL
/* Rights that apply to a non-directory: EXECUTE, WRITE_FILE, READ_FILE, TRUNCATE, IOCTL_DEV. */
#define SK_LL_FILE_RIGHTS ((1ULL << 0) | (1ULL << 1) | (1ULL << 2) | (1ULL << 14) | (1ULL << 15))

struct sk_ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct sk_ll_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

struct sk_ll_net_port_attr {
    uint64_t allowed_access;
    uint64_t port;
};

int sk_landlock_abi(void)
{
    long r = syscall(SK_NR_landlock_create_ruleset, NULL, 0, SK_LL_CREATE_RULESET_VERSION);
    return r < 0 ? -errno : (int)r;
}

static int add_ports(int rs, const unsigned short *ports, size_t n, uint64_t right, int rep)
{
    for (size_t i = 0; i < n; i++) {
        struct sk_ll_net_port_attr a = {.allowed_access = right, .port = ports[i]};
        if (syscall(SK_NR_landlock_add_rule, rs, SK_LL_RULE_NET_PORT, &a, 0) < 0) {
            sk_report(rep, SK_REP_ERROR, SK_STEP_LANDLOCK, errno, (int)ports[i], "net port rule");
            return -1;
        }
    }
    return 0;
}

int sk_landlock_child(const struct sk_landlock *ll, int rep)
{
    struct sk_ll_ruleset_attr attr = {
        .handled_access_fs = ll->handled_fs,
        .handled_access_net = ll->handled_net,
        .scoped = ll->scoped,
    };
    /* Older kernels reject a struct larger than they know unless the extra is zero;
     * pass only what this ABI understands. */
    size_t size = ll->scoped ? 24 : (ll->handled_net ? 16 : 8);
    int rs = (int)syscall(SK_NR_landlock_create_ruleset, &attr, size, 0);
    if (rs < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_LANDLOCK, errno, 0, "landlock_create_ruleset");
        return -1;
    }
    for (size_t i = 0; i < ll->n_rules; i++) {
        const struct sk_landlock_rule *r = &ll->rules[i];
        int fd = open(r->path, O_PATH | O_CLOEXEC);
        if (fd < 0) {
            if (r->optional && (errno == ENOENT || errno == ENOTDIR))
                continue;
            sk_report(rep, SK_REP_ERROR, SK_STEP_LANDLOCK, errno, (int)i, r->path);
            close(rs);
            return -1;
        }
        struct stat st;
        uint64_t access = r->access & ll->handled_fs;
        if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode))
            access &= SK_LL_FILE_RIGHTS;
        if (access) {
            struct sk_ll_path_beneath_attr pb = {.allowed_access = access, .parent_fd = fd};
            if (syscall(SK_NR_landlock_add_rule, rs, SK_LL_RULE_PATH_BENEATH, &pb, 0) < 0) {
                sk_report(rep, SK_REP_ERROR, SK_STEP_LANDLOCK, errno, (int)i, r->path);
                close(fd);
                close(rs);
                return -1;
            }
        }
        close(fd);
    }
    if (ll->handled_net) {
        if (add_ports(rs, ll->bind_ports, ll->n_bind_ports, SK_LL_NET_BIND_TCP, rep) < 0 ||
            add_ports(rs, ll->connect_ports, ll->n_connect_ports, SK_LL_NET_CONNECT_TCP, rep) < 0) {
            close(rs);
            return -1;
        }
    }
    /* restrict_flags: only ever set for ABI >= 7 (plan.py); older kernels refuse flags (EINVAL). */
    if (syscall(SK_NR_landlock_restrict_self, rs, ll->restrict_flags) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_LANDLOCK, errno, 0, "landlock_restrict_self");
        close(rs);
        return -1;
    }
    close(rs);
    return 0;
}
