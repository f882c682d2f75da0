/* How many bytes of each page of an XOR differ from zero (storage/delta.py, page_differences), in one
 * pass, called through ctypes (which releases the GIL for the whole call).
 *
 * A page's words are tested first (a good reference leaves most pages all zero); only a page with a
 * non-zero word has its bytes counted. Reads exactly N bytes of X and writes exactly
 * ceil(N / PAGE) counts: every length is the caller's, computed from its own buffers' sizes. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_CLONES
#endif

GS_CLONES
static size_t count_nonzero(const uint8_t *p, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += p[i] != 0;
    return c;
}

GS_CLONES
static int all_zero(const uint8_t *p, size_t n)
{
    uint64_t acc = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        acc |= w;
    }
    for (; i < n; i++) acc |= p[i];
    return acc == 0;
}

/* OUT[k] = the non-zero bytes of page K of X (N bytes, pages of PAGE bytes, the last one partial);
 * returns their sum. */
int64_t gs_page_differences(const uint8_t *x, size_t n, size_t page, int64_t *out)
{
    int64_t total = 0;
    if (page == 0) return 0;
    for (size_t k = 0, off = 0; off < n; k++, off += page) {
        size_t len = n - off < page ? n - off : page;
        int64_t c = all_zero(x + off, len) ? 0 : (int64_t)count_nonzero(x + off, len);
        out[k] = c;
        total += c;
    }
    return total;
}

int gs_pages_version(void) { return 1; }
