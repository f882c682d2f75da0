/* The byte planes of 2-byte elements (storage/codecs.py, Shuffle2Codec; FORMAT.md, "Codec ids") and of
 * 4-byte elements (Shuffle4Codec), in one pass each way, called through ctypes (which releases the GIL
 * for the whole call).
 *
 * Layout 1: the low plane is each element's low byte, the high plane its high byte.
 * Layout 2: each element is rotated left by one bit first, so the high plane is bits 7..14 (a bf16's
 *           exponent) and the low plane bits 0..6 shifted up by one with bit 15 (the sign) as bit 0.
 *
 * These functions read N elements and write N bytes per plane (or N elements), nothing else: every
 * length is the caller's, computed from sizes it has checked (no data in the buffers steers them).
 * Plain loops over fixed-width integers, which compilers vectorize; built for the generic x86-64
 * baseline and for AVX2, the better one picked when the library is loaded (target_clones). */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_CLONES
#endif

static inline uint16_t rotl1(uint16_t x) { return (uint16_t)((x << 1) | (x >> 15)); }
static inline uint16_t rotr1(uint16_t x) { return (uint16_t)((x >> 1) | (x << 15)); }

/* Plane WHICH (0 low, 1 high) of the N elements A, in LAYOUT, into OUT (N bytes). */
GS_CLONES
void gs_shuffle2_plane(const uint16_t *restrict a, size_t n, int which, int layout, uint8_t *restrict out)
{
    if (layout == 2) {
        if (which)
            for (size_t i = 0; i < n; i++) out[i] = (uint8_t)(rotl1(a[i]) >> 8);
        else
            for (size_t i = 0; i < n; i++) out[i] = (uint8_t)rotl1(a[i]);
    } else {
        if (which)
            for (size_t i = 0; i < n; i++) out[i] = (uint8_t)(a[i] >> 8);
        else
            for (size_t i = 0; i < n; i++) out[i] = (uint8_t)a[i];
    }
}

/* The N elements OUT from their planes LO and HI (N bytes each), in LAYOUT. */
GS_CLONES
void gs_shuffle2_merge(const uint8_t *restrict lo, const uint8_t *restrict hi, size_t n, int layout,
                       uint16_t *restrict out)
{
    if (layout == 2)
        for (size_t i = 0; i < n; i++) out[i] = rotr1((uint16_t)(((uint16_t)hi[i] << 8) | lo[i]));
    else
        for (size_t i = 0; i < n; i++) out[i] = (uint16_t)(((uint16_t)hi[i] << 8) | lo[i]);
}

/* libzstd's ZSTD_decompressDCtx, as the caller passes it (the library this process already loaded, so
 * this one links nothing): decodes one frame of SRC_N bytes into at most CAP bytes of DST, its size or
 * an error code (never CAP for an error: those are the last values of size_t). */
typedef size_t (*gs_zstd_decompress)(void *dctx, void *dst, size_t cap, const void *src, size_t src_n);

/* A whole shuffle2 payload's planes back into its 2 * H bytes OUT, in one call (one release of the GIL
 * for what took three ctypes calls): each plane K (0: stored, its H bytes at P; 1: one zstd frame of N
 * bytes at P that must decode to exactly H bytes) into SCRATCH (H bytes per zstd plane, the low plane's
 * first), then the merge. 0 when done; -1 or -2 when plane 0 or 1 did not decode to H bytes (OUT is then
 * garbage, the caller raises). The caller has checked every length: SCRATCH holds H bytes per zstd
 * plane, OUT 2 * H, no output overlaps an input, and each frame declares H bytes and spans its N. */
int gs_shuffle2_decode(const uint8_t *p0, size_t n0, int k0, const uint8_t *p1, size_t n1, int k1, size_t h,
                       int layout, uint8_t *scratch, uint16_t *out, void *dctx, void *decompress)
{
    gs_zstd_decompress dec = (gs_zstd_decompress)decompress;
    const uint8_t *lo = p0, *hi = p1;
    if (k0) {
        if (dec(dctx, scratch, h, p0, n0) != h)
            return -1;
        lo = scratch;
    }
    if (k1) {
        uint8_t *s = scratch + (k0 ? h : 0);
        if (dec(dctx, s, h, p1, n1) != h)
            return -2;
        hi = s;
    }
    gs_shuffle2_merge(lo, hi, h, layout, out);
    return 0;
}

/* Plane WHICH (0..3: byte WHICH of each little-endian element) of the N 4-byte elements A into OUT
 * (N bytes). */
GS_CLONES
void gs_shuffle4_plane(const uint32_t *restrict a, size_t n, int which, uint8_t *restrict out)
{
    const unsigned shift = 8u * (unsigned)(which & 3);
    for (size_t i = 0; i < n; i++) out[i] = (uint8_t)(a[i] >> shift);
}

/* The N 4-byte elements OUT from their planes P[0..3] (N bytes each). */
GS_CLONES
void gs_shuffle4_merge(const uint8_t *restrict p0, const uint8_t *restrict p1, const uint8_t *restrict p2,
                       const uint8_t *restrict p3, size_t n, uint32_t *restrict out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
}

/* A whole shuffle4 payload's planes back into its 4 * Q bytes OUT, in one call: plane K of P[K] (N[K]
 * bytes), stored (KIND[K] 0: its Q bytes) or one zstd frame (1) that must decode to exactly Q bytes,
 * decoded into SCRATCH (Q bytes per zstd plane, in plane order), then the merge. 0 when done; -1 - K when
 * plane K did not decode to Q bytes (OUT is then garbage, the caller raises). The caller has checked
 * every length, as for gs_shuffle2_decode. */
int gs_shuffle4_decode(const uint8_t *const p[4], const size_t n[4], const int kind[4], size_t q,
                       uint8_t *scratch, uint32_t *out, void *dctx, void *decompress)
{
    gs_zstd_decompress dec = (gs_zstd_decompress)decompress;
    const uint8_t *plane[4];
    uint8_t *s = scratch;
    for (int k = 0; k < 4; k++) {
        plane[k] = p[k];
        if (kind[k]) {
            if (dec(dctx, s, q, p[k], n[k]) != q)
                return -1 - k;
            plane[k] = s;
            s += q;
        }
    }
    gs_shuffle4_merge(plane[0], plane[1], plane[2], plane[3], q, out);
    return 0;
}

/* The ABI version of this library: storage/shufflelib.py loads only the one it was written for. */
int gs_shuffle2_version(void) { return 3; }
