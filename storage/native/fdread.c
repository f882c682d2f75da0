/* A descriptor read until a buffer is full or the writer is done, in one call through ctypes (which
 * releases the GIL for the whole call): storage/fdread.py.
 *
 * Reads at most LEN bytes into BUF, never more; loops over short reads (a pipe gives at most what it
 * holds, 1 MiB where fs.pipe-max-size is the kernel's default). Returns the bytes read: LEN, or fewer
 * at end of file, or fewer with *INTERRUPTED set to 1 when a signal interrupted a read (the caller
 * goes back to Python, whose handlers run there - SIGTERM must not wait for a stalled writer - and
 * calls again for the rest); -errno when a read fails (bytes read before it are then lost to the
 * caller, whose stream fails). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stddef.h>
#include <sys/types.h>
#include <unistd.h>

int gs_fdread_version(void) { return 2; }

long gs_read_full(int fd, void *buf, size_t len, int *interrupted)
{
    size_t got = 0;
    *interrupted = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n == 0)
            break;
        if (n < 0) {
            if (errno == EINTR) {
                *interrupted = 1;
                break;
            }
            return -(long)errno;
        }
        got += (size_t)n;
    }
    return (long)got;
}
