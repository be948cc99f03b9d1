/* caps.c: drop the capabilities (all, or all but `keep`) and lock the securebits
 * (child side). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

int sk_caps_child(unsigned long long keep, int rep)
{
    /* Locked so nothing later (setuid to 0, exec of a root-owned binary) regains caps.
     * Needs CAP_SETPCAP, so it comes first. With `keep` (root inside, a range of ids
     * mapped), root keeps those in its namespace as on any host: the bounding set
     * holds only them, exec as uid 0 gives them back, and leaving uid 0 drops them
     * (no SETUID_FIXUP). */
    unsigned long bits = SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE |
                         SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
    if (!keep)
        bits |= SECBIT_NOROOT | SECBIT_NO_SETUID_FIXUP | SECBIT_KEEP_CAPS_LOCKED;
    /* else PR_SET_KEEPCAPS stays open, as setpriv and su use it: it keeps only
     * what root already has, and exec clears it */
    if (prctl(PR_SET_SECUREBITS, bits, 0, 0, 0) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, 0, "PR_SET_SECUREBITS");
        return -1;
    }
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap))
            continue;
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
    data[0].effective = data[0].permitted = (uint32_t)keep;
    data[1].effective = data[1].permitted = (uint32_t)(keep >> 32);
    if (syscall(SYS_capset, &hdr, data) < 0) {
        sk_report(rep, SK_REP_ERROR, SK_STEP_CAPS, errno, 0, "capset");
        return -1;
    }
    return 0;
}
