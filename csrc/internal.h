/* Shared by the C sources; not part of the cffi API. */
#ifndef SK_INTERNAL_H
#define SK_INTERNAL_H

#include <stddef.h>
#include "stockade_native.h"

/* Child side: every function here is async-signal-safe (no malloc, no stdio). */
void sk_report(int fd, int kind, int step, int err, int value, const char *path);
int sk_mounts_child(const struct sk_plan *p, int rep);
int sk_landlock_child(const struct sk_landlock *ll, int rep);
int sk_seccomp_child(const unsigned char *bpf, size_t len, int rep);
int sk_caps_child(int rep);
void sk_init_child(const struct sk_plan *p, int rep) __attribute__((noreturn));
size_t sk_strlen(const char *s);

#endif
