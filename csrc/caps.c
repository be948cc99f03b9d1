/* caps.c: drop every capability and lock the securebits (child side). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

int sk_caps_child(int rep)
{
    /* Locked so nothing later (setuid to 0, exec of a root-owned binary) regains caps.
     * Needs CAP_SETPCAP, so it comes first. */
    unsigned long bits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                         SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED |
                         SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    if (prctl(PR_SET_SECUREBITS, bits, 0, 0, 0) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, 0, "PR_SET_SECUREBITS");
        return -1;
    }
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL)
                break; /* past the kernel's last capability */
            sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, cap, "PR_CAPBSET_DROP");
            return -1;
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, 0, "PR_CAP_AMBIENT_CLEAR_ALL");
        return -1;
    }
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, 0, "capset");
        return -1;
    }
    return 0;
}
