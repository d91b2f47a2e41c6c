/* The one copy of a batch: a producer's array into shared memory.
 *
 * A producer copies each array once, into a slot or a region, and the
 * trainer reads it later from another core. Ordinary stores first read
 * every destination line into the producer's cache (read-for-ownership)
 * and then fill the cache with bytes this core never reads again, evicting
 * the source array it is copying from. Above a few MiB that halves the
 * copy: measured on a 2-core EPYC VM (32 MiB L3), one thread copying a
 * cache-resident source into 8 rotating destinations, memcpy against
 * streaming (non-temporal) 16-byte stores, GB/s:
 *
 *     1 MiB  44 vs 31-35     2 MiB  32-38 vs 30-35     4 MiB  21-24 vs 36-37
 *     8 MiB  18-22 vs 29-36  16 MiB 15-19 vs 23-30     48 MB  14-15 vs 15-18
 *
 * so arrays of SHMP_STREAM_COPY_BYTES or more are copied with streaming
 * stores. (glibc's own switch to them is sized from the L3 that CPUID
 * reports, which in a VM can be the host's: 288 MiB on that one.) Would the
 * trainer find a smaller batch still in the cache? A producer that is ahead
 * fills the ring, and the trainer takes a batch only after `capacity` more
 * were written: gone from the cache either way at these sizes.
 *
 * Memory ordering: streaming stores are weakly ordered, even on x86. The
 * ring publishes a slot with a release store, which orders ordinary stores
 * only, so the copy ends with SFENCE: every byte is globally visible before
 * anything this thread stores after it (the slot's READY state).
 *
 * SSE2 only (part of x86-64 itself: no CPU dispatch): 32-byte stores were
 * no faster in the measurement above. Elsewhere, memcpy.
 */
#ifndef SHMPIPE_COPY_H
#define SHMPIPE_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define SHMP_STREAM_COPY_BYTES ((size_t)4 << 20)

static inline void shmp_copy_out(void *dst, const void *src, size_t n)
{
    const unsigned char *d0 = (const unsigned char *)dst, *s0 = (const unsigned char *)src;
    if (d0 < s0 + n && s0 < d0 + n) {
        /* Overlap: an array yielded again that lives in the very memory it
         * goes to (a kept view of a reservation, in another layout). The
         * loop below copies forwards; memmove is right in every case. */
        memmove(dst, src, n);
        return;
    }
#if defined(__x86_64__)
    if (n >= SHMP_STREAM_COPY_BYTES) {
        unsigned char *d = (unsigned char *)dst;
        const unsigned char *s = (const unsigned char *)src;
        /* Streaming stores need 16-byte aligned destinations (arrays in a
         * slot start on 64 bytes: head is 0 there). */
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + body, s + body, n - body);
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, n);
}

#endif /* SHMPIPE_COPY_H */
