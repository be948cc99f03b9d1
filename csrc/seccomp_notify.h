/* seccomp user notification's flags and ioctls, for headers older than the kernels that
 * have them (Debian 12's and Ubuntu 22.04's: 6.1, 5.15); the running kernel decides
 * (EINVAL where it lacks one). Shared by csrc/observe.c and benchmarks/notify_floor.c. */
#ifndef SK_SECCOMP_NOTIFY_H
#define SK_SECCOMP_NOTIFY_H

#include <linux/seccomp.h>

#ifndef SECCOMP_FILTER_FLAG_NEW_LISTENER
#define SECCOMP_FILTER_FLAG_NEW_LISTENER (1UL << 3)
#endif
#ifndef SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV
#define SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV (1UL << 5) /* Linux 5.19+ */
#endif
#ifndef SECCOMP_USER_NOTIF_FLAG_CONTINUE
#define SECCOMP_USER_NOTIF_FLAG_CONTINUE (1UL << 0)
#endif
#ifndef SECCOMP_IOCTL_NOTIF_SET_FLAGS
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64) /* Linux 6.6+ */
#endif
#ifndef SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (1UL << 0)
#endif

#endif
