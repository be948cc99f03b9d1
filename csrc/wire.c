/* wire.c: a Plan as bytes, for the launcher (zygote) process.
 *
 * The launcher is a separate small executable, so pointers cannot cross:
 * sk_plan_pack() flattens a struct sk_plan in the Python process and
 * sk_wire_unpack() rebuilds it in the launcher, with every string pointing
 * into the received buffer. Same machine, same build: native byte order.
 *
 * Two parts, both packed here: the plan (everything but its run fields; the
 * Python side keeps it packed for the next run of an equal plan) and the run
 * (struct sk_run: command, environment, cwd, the overlay's layers, fd slots),
 * packed per run. The launcher puts them together with sk_run_apply, the same
 * call a cold start makes: no one else writes or edits this format.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SK_WIRE_MAGIC 0x34504b53u /* "SKP4": a plan */
#define SK_RUN_MAGIC 0x31524b53u  /* "SKR1": a run */
#define SK_NULL_LEN 0xffffffffu

struct wbuf {
    unsigned char *p;
    size_t cap, len;
};

static void put(struct wbuf *w, const void *v, size_t n)
{
    if (w->len + n <= w->cap)
        memcpy(w->p + w->len, v, n);
    w->len += n;
}

static void put_u32(struct wbuf *w, uint32_t v) { put(w, &v, sizeof v); }
static void put_i32(struct wbuf *w, int32_t v) { put(w, &v, sizeof v); }
static void put_u64(struct wbuf *w, uint64_t v) { put(w, &v, sizeof v); }

/* A blob is its length, its bytes and a NUL (so strings can point into the buffer). */
static void put_blob(struct wbuf *w, const void *v, size_t n, int is_null)
{
    if (is_null) {
        put_u32(w, SK_NULL_LEN);
        return;
    }
    put_u32(w, (uint32_t)n);
    put(w, v, n);
    put(w, "", 1);
}

static void put_str(struct wbuf *w, const char *s) { put_blob(w, s, sk_strlen(s), s == NULL); }

static void put_strv(struct wbuf *w, const char *const *v)
{
    uint32_t n = 0;
    while (v && v[n])
        n++;
    put_u32(w, n);
    for (uint32_t i = 0; i < n; i++)
        put_str(w, v[i]);
}

size_t sk_plan_pack(const struct sk_plan *p, unsigned char *buf, size_t cap)
{
    struct wbuf w = {.p = buf, .cap = buf ? cap : 0, .len = 0};
    put_u32(&w, SK_WIRE_MAGIC);
    put_u64(&w, p->clone_flags);
    put_str(&w, p->uid_map);
    put_str(&w, p->gid_map);
    put_i32(&w, p->deny_setgroups);
    put_i32(&w, p->drop_groups);
    put_u32(&w, p->uid);
    put_u32(&w, p->gid);
    put_str(&w, p->stage_dir);
    put_u32(&w, (uint32_t)p->n_ops);
    for (size_t i = 0; i < p->n_ops; i++) {
        const struct sk_mount_op *o = &p->ops[i];
        put_i32(&w, o->kind);
        put_u32(&w, o->flags);
        put_u32(&w, o->mode);
        put_str(&w, o->source);
        put_str(&w, o->target);
        put_blob(&w, o->data, o->data ? (o->data_len ? o->data_len : sk_strlen(o->data)) : 0, o->data == NULL);
    }
    put_str(&w, p->hostname);
    put_i32(&w, p->lo_up);
    put_u32(&w, (uint32_t)p->n_rlimits);
    for (size_t i = 0; i < p->n_rlimits; i++) {
        put_i32(&w, p->rlimits[i].resource);
        put_u64(&w, p->rlimits[i].soft);
        put_u64(&w, p->rlimits[i].hard);
    }
    put_u32(&w, (uint32_t)p->n_keep_fds);
    for (size_t i = 0; i < p->n_keep_fds; i++)
        put_i32(&w, p->keep_fds[i]);
    put_i32(&w, p->drop_caps);
    put_u64(&w, p->keep_caps);
    put_i32(&w, p->no_new_privs);
    const struct sk_landlock *ll = &p->landlock;
    put_i32(&w, ll->abi);
    put_u64(&w, ll->handled_fs);
    put_u64(&w, ll->handled_net);
    put_u64(&w, ll->scoped);
    put_u32(&w, (uint32_t)ll->n_rules);
    for (size_t i = 0; i < ll->n_rules; i++) {
        put_str(&w, ll->rules[i].path);
        put_u64(&w, ll->rules[i].access);
        put_i32(&w, ll->rules[i].optional);
    }
    put_u32(&w, (uint32_t)ll->n_bind_ports);
    put(&w, ll->bind_ports, ll->n_bind_ports * sizeof(unsigned short));
    put_u32(&w, (uint32_t)ll->n_connect_ports);
    put(&w, ll->connect_ports, ll->n_connect_ports * sizeof(unsigned short));
    put_u32(&w, ll->restrict_flags);
    put_blob(&w, p->seccomp_bpf, p->seccomp_len, p->seccomp_bpf == NULL);
    put_u32(&w, SK_WIRE_MAGIC);
    return w.len;
}

size_t sk_run_pack(const struct sk_run *r, unsigned char *buf, size_t cap)
{
    struct wbuf w = {.p = buf, .cap = buf ? cap : 0, .len = 0};
    put_u32(&w, SK_RUN_MAGIC);
    put_strv(&w, r->argv);
    put_strv(&w, r->envp);
    put_str(&w, r->path_env);
    put_str(&w, r->cwd);
    put_u32(&w, (uint32_t)r->n_overlays);
    for (size_t i = 0; i < r->n_overlays; i++) {
        put_u32(&w, (uint32_t)r->overlays[i].op);
        put_str(&w, r->overlays[i].data);
    }
    for (int i = 0; i < 3; i++)
        put_i32(&w, r->stdio[i]);
    put_i32(&w, r->cgroup_fd);
    put_u32(&w, (uint32_t)r->n_cgroup_join_fds);
    for (size_t i = 0; i < r->n_cgroup_join_fds; i++)
        put_i32(&w, r->cgroup_join_fds[i]);
    put_i32(&w, r->pty);
    put_i32(&w, r->console_sock);
    put_i32(&w, r->hold_before_exec);
    put_i32(&w, r->serve_fd);
    put_i32(&w, r->hold_fd);
    put_i32(&w, r->observe_sock);
    put_blob(&w, r->observe_bpf, r->observe_len, r->observe_bpf == NULL);
    put_u32(&w, SK_RUN_MAGIC);
    return w.len;
}

int sk_run_apply(struct sk_plan *p, const struct sk_run *r)
{
    struct sk_mount_op *ops = (struct sk_mount_op *)p->ops; /* the caller's own, writable */
    for (size_t i = 0; i < r->n_overlays; i++) {
        size_t k = r->overlays[i].op;
        if (k >= p->n_ops || ops[k].kind != SK_OP_OVERLAY || !r->overlays[i].data)
            return -EINVAL;
    }
    for (size_t i = 0; i < r->n_overlays; i++) {
        ops[r->overlays[i].op].data = r->overlays[i].data;
        ops[r->overlays[i].op].data_len = sk_strlen(r->overlays[i].data);
    }
    p->argv = r->argv;
    p->envp = r->envp;
    p->path_env = r->path_env;
    p->cwd = r->cwd;
    for (int i = 0; i < 3; i++)
        p->stdio[i] = r->stdio[i];
    p->cgroup_fd = r->cgroup_fd;
    p->cgroup_join_fds = r->cgroup_join_fds;
    p->n_cgroup_join_fds = r->n_cgroup_join_fds;
    p->pty = r->pty;
    p->console_sock = r->console_sock;
    p->hold_before_exec = r->hold_before_exec;
    p->serve_fd = r->serve_fd;
    p->observe_sock = r->observe_sock;
    p->observe_bpf = r->observe_bpf;
    p->observe_len = r->observe_len;
    return 0;
}

struct rbuf {
    const unsigned char *p;
    size_t len, off;
    int bad;
};

static const void *take(struct rbuf *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = 1;
        return NULL;
    }
    const void *v = r->p + r->off;
    r->off += n;
    return v;
}

static uint32_t get_u32(struct rbuf *r)
{
    uint32_t v = 0;
    const void *s = take(r, sizeof v);
    if (s)
        memcpy(&v, s, sizeof v);
    return v;
}

static int32_t get_i32(struct rbuf *r) { return (int32_t)get_u32(r); }

static uint64_t get_u64(struct rbuf *r)
{
    uint64_t v = 0;
    const void *s = take(r, sizeof v);
    if (s)
        memcpy(&v, s, sizeof v);
    return v;
}

static const char *get_blob(struct rbuf *r, size_t *len)
{
    uint32_t n = get_u32(r);
    if (len)
        *len = 0;
    if (r->bad || n == SK_NULL_LEN)
        return NULL;
    const char *s = take(r, (size_t)n + 1);
    if (!s || s[n] != '\0') {
        r->bad = 1;
        return NULL;
    }
    if (len)
        *len = n;
    return s;
}

static const char *get_str(struct rbuf *r) { return get_blob(r, NULL); }

/* Counts come from our own packer, but bound them so a bad message cannot
 * make us allocate without limit. */
static size_t get_count(struct rbuf *r, size_t max)
{
    uint32_t n = get_u32(r);
    if (n > max)
        r->bad = 1;
    return r->bad ? 0 : n;
}

static const char **get_strv(struct rbuf *r)
{
    size_t n = get_count(r, 1 << 20);
    const char **v = calloc(n + 1, sizeof *v);
    if (!v) {
        r->bad = 1;
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        v[i] = get_str(r);
    return v;
}

void sk_plan_free(struct sk_plan *p)
{
    free((void *)p->ops);
    free((void *)p->rlimits);
    free((void *)p->keep_fds);
    free((void *)p->cgroup_join_fds);
    free((void *)p->landlock.rules);
    free((void *)p->landlock.bind_ports);
    free((void *)p->landlock.connect_ports);
    free((void *)p->argv);
    free((void *)p->envp);
    memset(p, 0, sizeof *p);
}

static int plan_unpack(const unsigned char *buf, size_t len, struct sk_plan *p)
{
    struct rbuf r = {.p = buf, .len = len, .off = 0, .bad = 0};
    memset(p, 0, sizeof *p);
    p->cgroup_fd = p->console_sock = p->serve_fd = p->launcher_exec_fd = p->launcher_ctl_fd = p->observe_sock = -1;
    p->stdio[0] = p->stdio[1] = p->stdio[2] = -1;
    if (get_u32(&r) != SK_WIRE_MAGIC)
        return -EINVAL;
    p->clone_flags = get_u64(&r);
    p->uid_map = get_str(&r);
    p->gid_map = get_str(&r);
    p->deny_setgroups = get_i32(&r);
    p->drop_groups = get_i32(&r);
    p->uid = get_u32(&r);
    p->gid = get_u32(&r);
    p->stage_dir = get_str(&r);
    p->n_ops = get_count(&r, 1 << 16);
    struct sk_mount_op *ops = calloc(p->n_ops + 1, sizeof *ops);
    p->ops = ops;
    for (size_t i = 0; ops && i < p->n_ops; i++) {
        ops[i].kind = get_i32(&r);
        ops[i].flags = get_u32(&r);
        ops[i].mode = get_u32(&r);
        ops[i].source = get_str(&r);
        ops[i].target = get_str(&r);
        ops[i].data = get_blob(&r, &ops[i].data_len);
    }
    p->hostname = get_str(&r);
    p->lo_up = get_i32(&r);
    p->n_rlimits = get_count(&r, 64);
    struct sk_rlimit *rl = calloc(p->n_rlimits + 1, sizeof *rl);
    p->rlimits = rl;
    for (size_t i = 0; rl && i < p->n_rlimits; i++) {
        rl[i].resource = get_i32(&r);
        rl[i].soft = get_u64(&r);
        rl[i].hard = get_u64(&r);
    }
    p->n_keep_fds = get_count(&r, 256);
    int *kf = calloc(p->n_keep_fds + 1, sizeof *kf);
    p->keep_fds = kf;
    for (size_t i = 0; kf && i < p->n_keep_fds; i++)
        kf[i] = get_i32(&r);
    p->drop_caps = get_i32(&r);
    p->keep_caps = get_u64(&r);
    p->no_new_privs = get_i32(&r);
    struct sk_landlock *ll = &p->landlock;
    ll->abi = get_i32(&r);
    ll->handled_fs = get_u64(&r);
    ll->handled_net = get_u64(&r);
    ll->scoped = get_u64(&r);
    ll->n_rules = get_count(&r, 1 << 16);
    struct sk_landlock_rule *rules = calloc(ll->n_rules + 1, sizeof *rules);
    ll->rules = rules;
    for (size_t i = 0; rules && i < ll->n_rules; i++) {
        rules[i].path = get_str(&r);
        rules[i].access = get_u64(&r);
        rules[i].optional = get_i32(&r);
    }
    for (int k = 0; k < 2; k++) {
        size_t n = get_count(&r, 1 << 16);
        unsigned short *ports = calloc(n + 1, sizeof *ports);
        const void *src = take(&r, n * sizeof *ports);
        if (ports && src)
            memcpy(ports, src, n * sizeof *ports);
        if (k == 0) {
            ll->bind_ports = ports;
            ll->n_bind_ports = n;
        } else {
            ll->connect_ports = ports;
            ll->n_connect_ports = n;
        }
    }
    ll->restrict_flags = get_u32(&r);
    p->seccomp_bpf = (const unsigned char *)get_blob(&r, &p->seccomp_len);
    if (get_u32(&r) != SK_WIRE_MAGIC || !ops || !rl || !kf || !rules || !ll->bind_ports ||
        !ll->connect_ports || r.off != r.len)
        r.bad = 1;
    if (r.bad) {
        sk_plan_free(p);
        return -EINVAL;
    }
    return 0;
}

/* A run part: its arrays allocated (argv, envp, join fds: the plan owns them once
 * applied; overlays: freed by the caller), its strings in buf. */
static int run_unpack(const unsigned char *buf, size_t len, struct sk_run *run)
{
    struct rbuf r = {.p = buf, .len = len, .off = 0, .bad = 0};
    memset(run, 0, sizeof *run);
    if (get_u32(&r) != SK_RUN_MAGIC)
        return -EINVAL;
    run->argv = get_strv(&r);
    run->envp = get_strv(&r);
    run->path_env = get_str(&r);
    run->cwd = get_str(&r);
    run->n_overlays = get_count(&r, 64);
    struct sk_overlay_data *ov = calloc(run->n_overlays + 1, sizeof *ov);
    run->overlays = ov;
    for (size_t i = 0; ov && i < run->n_overlays; i++) {
        ov[i].op = get_u32(&r);
        ov[i].data = get_str(&r);
    }
    for (int i = 0; i < 3; i++)
        run->stdio[i] = get_i32(&r);
    run->cgroup_fd = get_i32(&r);
    run->n_cgroup_join_fds = get_count(&r, 16);
    int *jf = calloc(run->n_cgroup_join_fds + 1, sizeof *jf);
    run->cgroup_join_fds = jf;
    for (size_t i = 0; jf && i < run->n_cgroup_join_fds; i++)
        jf[i] = get_i32(&r);
    run->pty = get_i32(&r);
    run->console_sock = get_i32(&r);
    run->hold_before_exec = get_i32(&r);
    run->serve_fd = get_i32(&r);
    run->hold_fd = get_i32(&r);
    run->observe_sock = get_i32(&r);
    run->observe_bpf = (const unsigned char *)get_blob(&r, &run->observe_len);
    if (get_u32(&r) != SK_RUN_MAGIC || !ov || !jf || !run->argv || !run->envp || !run->argv[0] || r.off != r.len)
        r.bad = 1;
    if (r.bad) {
        free((void *)run->argv);
        free((void *)run->envp);
        free((void *)run->overlays);
        free((void *)run->cgroup_join_fds);
        memset(run, 0, sizeof *run);
        return -EINVAL;
    }
    return 0;
}

int sk_wire_unpack(const unsigned char *plan, size_t plan_len, const unsigned char *run, size_t run_len,
                   struct sk_plan *p, int *hold_fd)
{
    *hold_fd = -1;
    int e = plan_unpack(plan, plan_len, p);
    if (e < 0 || run_len == 0)
        return e;
    struct sk_run r;
    if ((e = run_unpack(run, run_len, &r)) < 0) {
        sk_plan_free(p);
        return e;
    }
    e = sk_run_apply(p, &r); /* the plan now owns argv, envp and the join fds */
    free((void *)r.overlays);
    if (e < 0) {
        sk_plan_free(p);
        return e;
    }
    *hold_fd = r.hold_fd;
    return 0;
}
