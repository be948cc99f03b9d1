/* wire.c: a Plan as bytes, for the launcher (zygote) process.
 *
 * The launcher is a separate small executable, so pointers cannot cross:
 * sk_plan_pack() flattens a struct sk_plan in the Python process and
 * sk_plan_unpack() rebuilds it in the launcher, with every string pointing
 * into the received buffer. Same machine, same build: native byte order.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SK_WIRE_MAGIC 0x32504b53u /* "SKP2" */
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
    put_i32(&w, p->cgroup_fd);
    put_u32(&w, (uint32_t)p->n_cgroup_join_fds);
    for (size_t i = 0; i < p->n_cgroup_join_fds; i++)
        put_i32(&w, p->cgroup_join_fds[i]);
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
    put_str(&w, p->cwd);
    put_u32(&w, (uint32_t)p->n_rlimits);
    for (size_t i = 0; i < p->n_rlimits; i++) {
        put_i32(&w, p->rlimits[i].resource);
        put_u64(&w, p->rlimits[i].soft);
        put_u64(&w, p->rlimits[i].hard);
    }
    for (int i = 0; i < 3; i++)
        put_i32(&w, p->stdio[i]);
    put_u32(&w, (uint32_t)p->n_keep_fds);
    for (size_t i = 0; i < p->n_keep_fds; i++)
        put_i32(&w, p->keep_fds[i]);
    put_i32(&w, p->pty);
    put_i32(&w, p->console_sock);
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
    put_blob(&w, p->seccomp_bpf, p->seccomp_len, p->seccomp_bpf == NULL);
    put_strv(&w, p->argv);
    put_strv(&w, p->envp);
    put_str(&w, p->path_env);
    put_i32(&w, p->hold_before_exec);
    put_i32(&w, p->skip_first_go);
    put_u32(&w, SK_WIRE_MAGIC);
    return w.len;
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

int sk_plan_unpack(const unsigned char *buf, size_t len, struct sk_plan *p)
{
    struct rbuf r = {.p = buf, .len = len, .off = 0, .bad = 0};
    memset(p, 0, sizeof *p);
    if (get_u32(&r) != SK_WIRE_MAGIC)
        return -EINVAL;
    p->clone_flags = get_u64(&r);
    p->cgroup_fd = get_i32(&r);
    p->n_cgroup_join_fds = get_count(&r, 16);
    int *jf = calloc(p->n_cgroup_join_fds + 1, sizeof *jf);
    p->cgroup_join_fds = jf;
    for (size_t i = 0; jf && i < p->n_cgroup_join_fds; i++)
        jf[i] = get_i32(&r);
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
    p->cwd = get_str(&r);
    p->n_rlimits = get_count(&r, 64);
    struct sk_rlimit *rl = calloc(p->n_rlimits + 1, sizeof *rl);
    p->rlimits = rl;
    for (size_t i = 0; rl && i < p->n_rlimits; i++) {
        rl[i].resource = get_i32(&r);
        rl[i].soft = get_u64(&r);
        rl[i].hard = get_u64(&r);
    }
    for (int i = 0; i < 3; i++)
        p->stdio[i] = get_i32(&r);
    p->n_keep_fds = get_count(&r, 256);
    int *kf = calloc(p->n_keep_fds + 1, sizeof *kf);
    p->keep_fds = kf;
    for (size_t i = 0; kf && i < p->n_keep_fds; i++)
        kf[i] = get_i32(&r);
    p->pty = get_i32(&r);
    p->console_sock = get_i32(&r);
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
    p->seccomp_bpf = (const unsigned char *)get_blob(&r, &p->seccomp_len);
    p->argv = get_strv(&r);
    p->envp = get_strv(&r);
    p->path_env = get_str(&r);
    p->hold_before_exec = get_i32(&r);
    p->skip_first_go = get_i32(&r);
    if (get_u32(&r) != SK_WIRE_MAGIC || !jf || !ops || !rl || !kf || !rules || !ll->bind_ports ||
        !ll->connect_ports || r.off != r.len)
        r.bad = 1;
    if (r.bad) {
        sk_plan_free(p);
        return -EINVAL;
    }
    return 0;
}
