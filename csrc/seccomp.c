/* seccomp.c: install the BPF program the parent compiled (the last step before init). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>

#include "internal.h"

int sk_seccomp_child(const unsigned char *bpf, size_t len, int rep)
{
    struct sock_fprog prog = {
        .len = (unsigned short)(len / sizeof(struct sock_filter)),
        .filter = (struct sock_filter *)(void *)bpf,
    };
    if (len % sizeof(struct sock_filter) || len / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_SECCOMP, EINVAL, 0, "bpf length");
        return -1;
    }
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_SECCOMP, errno, 0, "PR_SET_SECCOMP");
        return -1;
    }
    return 0;
}
