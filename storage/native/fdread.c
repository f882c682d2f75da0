/* A descriptor read until a buffer is full or the writer is done, through ctypes (which releases the
 * GIL for each call): storage/fdread.py.
 *
 * Reads at most LEN bytes into BUF, never more; goes on over short reads while more is ready (a pipe
 * gives at most what it holds, 1 MiB where fs.pipe-max-size is the kernel's default). Returns the
 * bytes read: LEN, or fewer at end of file, or fewer with *AGAIN set to 1 when the next read would
 * wait or a signal interrupted one. The caller then goes back to Python, whose signal handlers run
 * there (SIGTERM must not wait for a stalled writer, whether the signal came while a read waited or
 * while one copied), and calls again for the rest. -errno when a read fails (bytes read before it are
 * then lost to the caller, whose stream fails). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <sys/types.h>
#include <unistd.h>

int gs_fdread_version(void) { return 3; }

long gs_read_full(int fd, void *buf, size_t len, int *again)
{
    size_t got = 0;
    *again = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n == 0)
            break;
        if (n < 0) {
            if (errno == EINTR) {
                *again = 1;
                break;
            }
            return -(long)errno;
        }
        got += (size_t)n;
        if (got < len) {
            struct pollfd p = { .fd = fd, .events = POLLIN, .revents = 0 };
            if (poll(&p, 1, 0) <= 0) { /* nothing ready (or a signal): back to Python before waiting */
                *again = 1;
                break;
            }
        }
    }
    return (long)got;
}
