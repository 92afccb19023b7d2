/* y = x W^T with W in a GGUF block format, read in place: the torch runner's matmul for the
 * tensors a file stores as Q4_0, Q5_0 or Q8_0 (blocks of 32 weights with a float16 scale d).
 *
 * As llama.cpp computes them: each row of x is quantized to 8 bits in blocks of 32 (scale
 * max|x| / 127, kept as float16; values rounded to nearest even), the weights are unpacked to
 * signed 8-bit integers (Q4_0: nibble - 8; Q5_0: nibble + 16 * high bit - 16; Q8_0 as
 * stored), each block's products are summed in integers and scaled once by d_w * d_x.
 *
 * Rows of W are shared out to the thread pool. Where the CPU has AVX-512 VNNI, tiles of 4 rows
 * of W by 4 rows of x (below); elsewhere a row of W at a time against 4 rows of x. Every tier
 * gives the same bits: the integer sums are exact and the float part is added in one order
 * (rows_scalar). K-quant super-blocks are kquant.c's.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "localllm_native.h"

#define QK 32

typedef struct {
    int8_t q[QK];
} qblock_t;

static inline float round_to_f16(float x) {
#ifdef __FLT16_MAX__
    return (float)(_Float16)x;
#else
    return x; /* without a float16 type: the scale unrounded (a hair more precise than llama.cpp) */
#endif
}

/* static inline, and the exported lm_block_bytes its copy: a shared library's exported
 * function is not inlined (it could be interposed), and a call inside a loop cost the AVX-512
 * loop a spill of its sums and 40 % of its time */
static inline int block_bytes(int wtype) {
    switch (wtype) {
    case LM_Q4_0: return 18;
    case LM_Q5_0: return 22;
    case LM_Q8_0: return 34;
    case LM_Q5_0P: return 22; /* a pair of blocks in 44 bytes */
    case LM_Q4_0P: return 18; /* a pair of blocks in 36 bytes */
    case LM_Q5_0X: return 22;
    default: return 0;
    }
}

int lm_block_bytes(int wtype) { return block_bytes(wtype); }

/* The 32 weights of one block as signed integers, and its scale. */
static inline float unpack_block(int wtype, const uint8_t *b, int8_t *w) {
    uint16_t d;
    memcpy(&d, b, 2);
    if (wtype == LM_Q8_0) {
        memcpy(w, b + 2, QK);
    } else if (wtype == LM_Q4_0) {
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            w[j] = (int8_t)((qs[j] & 0x0f) - 8);
            w[j + 16] = (int8_t)((qs[j] >> 4) - 8);
        }
    } else { /* Q5_0 */
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            w[j] = (int8_t)(((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
            w[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
    }
    return lm_half_to_float(d);
}

/* ---- x86-64: AVX2, and AVX-512 VNNI where the CPU has it ------------------------------- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LM_X86 1

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))

AVX2_TARGET static inline __m256i bytes_from_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(_mm256_set1_epi8(0x0f), b);
}

/* 0xff in byte j where bit j of the 32 bits at x is set (llama.cpp's bytes_from_bits_32). */
AVX2_TARGET static inline __m256i bytes_from_bits(const uint8_t *x) {
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

AVX2_TARGET static inline __m256i unpack_avx2(int wtype, const uint8_t *b) {
    if (wtype == LM_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (wtype == LM_Q4_0) return _mm256_sub_epi8(bytes_from_nibbles(b + 2), _mm256_set1_epi8(8));
    /* Q5_0: where the high bit is clear the value is nibble - 16, i.e. nibble | 0xf0. */
    __m256i hi = _mm256_andnot_si256(bytes_from_bits(b + 2), _mm256_set1_epi8((char)0xf0));
    return _mm256_or_si256(bytes_from_nibbles(b + 6), hi);
}

AVX2_TARGET static inline float hsum(__m256 v) { /* lm_sum8's order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x's block scales for the 256-bit loops, laid out so that one multiply makes the scales
 * d_w * d_x of a pair of weight blocks for 4 rows of x: per 4 rows of x (a tile) and pair of
 * blocks p, 8 floats, lanes 2i and 2i + 1 row i's scales of blocks 2p and 2p + 1 (zeros past
 * the last row or block). A weight pair's two scales as [d0 d1 d0 d1 ...] times these are the
 * 8 products the tile needs: one multiply a pair instead of one a block and row of x. */
static float *tile_scales(const float *xd, int M, int nb) {
    const int tiles = (M + 3) / 4, pairs = (nb + 1) / 2;
    float *dt = aligned_alloc(32, sizeof(float) * 8 * ((size_t)tiles * pairs + 1));
    if (dt == NULL) return NULL;
    for (int t = 0; t < tiles; t++)
        for (int p = 0; p < pairs; p++)
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < 2; k++) {
                    const int m = 4 * t + i, b = 2 * p + k;
                    dt[((size_t)t * pairs + p) * 8 + 2 * i + k] = m < M && b < nb ? xd[(size_t)m * nb + b] : 0.0f;
                }
    return dt;
}

/* Rows n0..n1 of W against M rows of x with NAME##_row: W in runs of ROWS_RUN rows, each run
 * against the rows of x 4 at a time, so a run's rows and 4 rows of x stay in the first-level
 * cache while they meet. dt: tile_scales. */
#define ROWS_RUN 16
#define ROWS_RUNS(NAME, TARGET)                                                                         \
    TARGET static void NAME(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,     \
                            const qblock_t *xq, const float *xd, const float *dt, const __m256i *xc, int M,  \
                            float *y, int N) {                                                          \
        for (int r0 = n0; r0 < n1; r0 += ROWS_RUN)                                                      \
            for (int m0 = 0; m0 < M; m0 += 4)                                                           \
                for (int n = r0; n < n1 && n < r0 + ROWS_RUN; n++) {                                    \
                    const int mc = M - m0 < 4 ? M - m0 : 4;                                             \
                    const uint8_t *row = w + (size_t)n * row_bytes;                                     \
                    const qblock_t *xs = xq + (size_t)m0 * nb;                                          \
                    const float *ds = xd + (size_t)m0 * nb, *dts = dt ? dt + (size_t)(m0 / 4) * ((nb + 1) / 2) * 8 : NULL; \
                    const __m256i *cs = xc != NULL ? xc + (size_t)m0 * nb : NULL;                       \
                    float *yt = y + (size_t)m0 * N;                                                     \
                    switch (mc) { /* each a constant, so the sums stay in registers */                 \
                    case 1: NAME##_row(wtype, row, nb, xs, ds, dts, cs, 1, yt, N, n); break;            \
                    case 2: NAME##_row(wtype, row, nb, xs, ds, dts, cs, 2, yt, N, n); break;            \
                    case 3: NAME##_row(wtype, row, nb, xs, ds, dts, cs, 3, yt, N, n); break;            \
                    default: NAME##_row(wtype, row, nb, xs, ds, dts, cs, 4, yt, N, n);                  \
                    }                                                                                   \
                }                                                                                       \
    }

/* The AVX2 and AVX-VNNI loops: a row of W at a time against up to 4 rows of x, its blocks
 * unpacked once for the 4. Block b's 8 lane sums go to the accumulator of its parity (the lanes
 * (b % 2) * 8 .. + 7 of lm_sum16's order), as the AVX-512 loops hold a pair of blocks in one
 * vector: the same bits on every tier. The scales d_w * d_x of a pair of blocks for the 4 rows
 * of x are one multiply (tile_scales), kept on the stack, and each is broadcast from there to
 * its block's fma (a load, not a shuffle): a multiply a block and row of x cost a tenth of the
 * loop on a Zen 2 core, where the integer multiplies and the float ones share two pipes. (Unpacking
 * a run of rows once into scratch for all the rows of x was tried: within 10 % either way from
 * 8 to 128 rows, the products cost more than the unpacking.)
 *
 * AVX2: the sign trick, |w| times x with w's signs (maddubs: unsigned by signed bytes), then
 * madd to 4-product sums. AVX-VNNI: the weights unsigned, u = w + offset (Q4_0: the nibble, 8;
 * Q5_0: 16; Q8_0: w ^ 0x80, 128), and one vpdpbusd from a start value of -offset times x's
 * sums per 4 (made once per row of x): the same integers, two instructions fewer a block and
 * row of x. */
#define ROWS_LOOP(NAME, TARGET, UNPACK, DOT)                                                            \
    TARGET static inline __attribute__((always_inline)) void NAME##_block(                             \
        int wtype, const uint8_t *blk, int b, int nb, const qblock_t *xq, const float *xd, const float *sc, \
        const __m256i *xc, int mc, __m256 *acc) {                                                       \
        uint16_t dh;                                                                                    \
        memcpy(&dh, blk, 2);                                                                            \
        __m256i q, aq;                                                                                  \
        UNPACK(wtype, blk, q, aq);                                                                      \
        (void)aq; /* (the unsigned loop reads q alone) */                                               \
        for (int i = 0; i < mc; i++) {                                                                  \
            const size_t xi = (size_t)i * nb + b;                                                       \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)xq[xi].q);                           \
            const __m256i s32 = DOT(q, aq, xv, xc, xi);                                                 \
            /* one row: the block's scale d_w * d_x made here, as short a chain as can be */            \
            const __m256 scale = mc == 1 ? _mm256_mul_ps(_mm256_set1_ps(lm_half_to_float(dh)), _mm256_broadcast_ss(xd + b)) \
                                         : _mm256_broadcast_ss(sc + 2 * i);                             \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc[i]);                           \
        }                                                                                               \
    }                                                                                                   \
                                                                                                        \
    TARGET static inline __attribute__((always_inline)) void NAME##_row(                               \
        int wtype, const uint8_t *row, int nb, const qblock_t *xq, const float *xd, const float *dt,     \
        const __m256i *xc, int mc, float *y, int N, int n) {                                            \
        const int bb = block_bytes(wtype);                                                              \
        float sc[8] __attribute__((aligned(32)));                                                       \
        __m256 acc[2][4];                                                                               \
        for (int i = 0; i < 4; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();                        \
        /* two blocks a turn, so each parity's accumulators are named, not indexed (registers) */   \
        for (int b = 0; b < nb; b += 2) {                                                               \
            LM_PREFETCH(row + (size_t)b * bb);                                                          \
            LM_PREFETCH(row + (size_t)b * bb + 64);                                                     \
            if (mc > 1) {                                                                               \
                uint16_t h[2] = {0, 0};                                                                 \
                memcpy(&h[0], row + (size_t)b * bb, 2);                                                 \
                if (b + 1 < nb) memcpy(&h[1], row + (size_t)(b + 1) * bb, 2);                          \
                int32_t h2;                                                                             \
                memcpy(&h2, h, 4);                                                                      \
                _mm256_store_ps(sc, _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi32(h2)), _mm256_load_ps(dt + (size_t)b * 4))); \
            }                                                                                           \
            NAME##_block(wtype, row + (size_t)b * bb, b, nb, xq, xd, sc, xc, mc, acc[0]);              \
            if (b + 1 < nb) NAME##_block(wtype, row + (size_t)(b + 1) * bb, b + 1, nb, xq, xd, sc + 1, xc, mc, acc[1]); \
        }                                                                                               \
        for (int i = 0; i < mc; i++) y[(size_t)i * N + n] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));  \
    }                                                                                                   \
                                                                                                        \
    ROWS_RUNS(NAME, TARGET)

/* AVX2: q = w, aq = |w| */
#define UNPACK_SIGNED(wtype, blk, q, aq) (q = unpack_avx2(wtype, blk), aq = _mm256_sign_epi8(q, q))
#define DOT_SIGNED(q, aq, xv, xc, xi) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q)), _mm256_set1_epi16(1))
/* AVX-VNNI: q = u = w + offset (aq unused), xc[xi] = -offset * x's sums per 4 */
#define UNPACK_UNSIGNED(wtype, blk, q, aq) (q = unpack_unsigned(wtype, blk), aq = q)
#define DOT_UNSIGNED(q, aq, xv, xc, xi) _mm256_dpbusd_avx_epi32(_mm256_load_si256(xc + (xi)), q, xv)

static inline int unsigned_offset(int wtype) {
    return wtype == LM_Q8_0 ? 128 : wtype == LM_Q4_0 || wtype == LM_Q4_0P ? 8 : 16;
}

VNNI_TARGET static inline __m256i unpack_unsigned(int wtype, const uint8_t *b) {
    if (wtype == LM_Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    if (wtype == LM_Q4_0) return bytes_from_nibbles(b + 2);
    return _mm256_or_si256(bytes_from_nibbles(b + 6), _mm256_and_si256(bytes_from_bits(b + 2), _mm256_set1_epi8(0x10)));
}

/* -offset times each 4 values' sum, for every block of the M rows of x: the start values of the
 * unsigned products (maddubs' pair sums are at most 128 * 254, within 16 bits). */
AVX2_TARGET static void unsigned_corrections(int offset, const qblock_t *xq, size_t blocks, __m256i *out) {
    const __m256i off = _mm256_set1_epi8((char)offset);
    for (size_t i = 0; i < blocks; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)xq[i].q);
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(off, x), _mm256_set1_epi16(1));
        out[i] = _mm256_sub_epi32(_mm256_setzero_si256(), sums);
    }
}

ROWS_LOOP(rows_avx2, AVX2_TARGET, UNPACK_SIGNED, DOT_SIGNED)
ROWS_LOOP(rows_vnni, VNNI_TARGET, UNPACK_UNSIGNED, DOT_UNSIGNED)

/* Q4_0 / Q5_0 in pairs of blocks (LM_Q4_0P / LM_Q5_0P, laid out below for AVX-512; LM_Q5_0X) on
 * AVX2 and AVX-VNNI: a pair's 32 bytes of nibbles unpack into both blocks' unsigned values in
 * four instructions (each block alone takes four), and the products are the unsigned ones from
 * -offset times x's sums, each block into its parity's accumulator: the same bits as the
 * file's blocks. Q5_0's 64 high bits: in LM_Q5_0P's order (bit i: lane i) bytes_from_bits
 * spreads them, eight instructions a pair; LM_Q5_0X, the layout these tiers are given, holds
 * lane 8L + k (lanes 32.. block 1's) in bit L of byte k, so that one broadcast of the 8 bytes
 * and a shift of each 64-bit quarter by its own count bring every lane's bit to bit 4 of its
 * byte: five instructions. */
AVX2_TARGET static inline void pair_unsigned_avx2(int wtype, const uint8_t *pair, __m256i *u0, __m256i *u1) {
    const int five = wtype == LM_Q5_0P || wtype == LM_Q5_0X;
    const __m256i nib = _mm256_loadu_si256((const __m256i *)(pair + 4 + (five ? 8 : 0))), m = _mm256_set1_epi8(0x0f);
    *u0 = _mm256_and_si256(nib, m);
    *u1 = _mm256_and_si256(_mm256_srli_epi16(nib, 4), m);
    const __m256i h = _mm256_set1_epi8(0x10);
    if (wtype == LM_Q5_0X) { /* quarter L, byte k: bit L (block 0) left by 4 - L, bit 4 + L (block 1) right by L */
        int64_t bits;
        memcpy(&bits, pair + 4, 8);
        const __m256i hb = _mm256_set1_epi64x(bits);
        *u0 = _mm256_or_si256(*u0, _mm256_and_si256(_mm256_sllv_epi64(hb, _mm256_setr_epi64x(4, 3, 2, 1)), h));
        *u1 = _mm256_or_si256(*u1, _mm256_and_si256(_mm256_srlv_epi64(hb, _mm256_setr_epi64x(0, 1, 2, 3)), h));
    } else if (five) { /* 64 high bits after the scales: block 0's 32, then block 1's */
        *u0 = _mm256_or_si256(*u0, _mm256_and_si256(bytes_from_bits(pair + 4), h));
        *u1 = _mm256_or_si256(*u1, _mm256_and_si256(bytes_from_bits(pair + 8), h));
    }
}

#define DOTU_AVX2(u, xv, c) _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1)), c)
#define DOTU_VNNI(u, xv, c) _mm256_dpbusd_avx_epi32(c, u, xv)

#define PAIRS_LOOP(NAME, TARGET, DOTU)                                                                  \
    TARGET static inline __attribute__((always_inline)) void NAME##_row(                               \
        int wtype, const uint8_t *row, int nb, const qblock_t *xq, const float *xd, const float *dt,     \
        const __m256i *xc, int mc, float *y, int N, int n) {                                            \
        const int pb = wtype == LM_Q4_0P ? 36 : 44;                                                     \
        float sc[8] __attribute__((aligned(32)));                                                       \
        __m256 acc0[4], acc1[4];                                                                        \
        for (int i = 0; i < 4; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();                            \
        for (int b = 0; b < nb; b += 2) {                                                               \
            const uint8_t *pair = row + (size_t)(b / 2) * pb;                                           \
            LM_PREFETCH(pair);                                                                          \
            int32_t h2;                                                                                 \
            memcpy(&h2, pair, 4); /* both scales at once, d0 d1 d0 d1 ..., times the tile's x scales */ \
            const __m256 dd = _mm256_cvtph_ps(_mm_set1_epi32(h2));                                      \
            __m256 one0 = dd, one1 = dd;                                                                \
            if (mc == 1) {                                                                              \
                one0 = _mm256_mul_ps(_mm256_moveldup_ps(dd), _mm256_broadcast_ss(xd + b));             \
                one1 = _mm256_mul_ps(_mm256_movehdup_ps(dd), _mm256_broadcast_ss(xd + b + 1));         \
            } else {                                                                                    \
                _mm256_store_ps(sc, _mm256_mul_ps(dd, _mm256_load_ps(dt + (size_t)b * 4)));              \
            }                                                                                           \
            __m256i u0, u1;                                                                             \
            pair_unsigned_avx2(wtype, pair, &u0, &u1);                                                  \
            for (int i = 0; i < mc; i++) {                                                              \
                const size_t xi = (size_t)i * nb + b;                                                   \
                const __m256i s0 = DOTU(u0, _mm256_loadu_si256((const __m256i *)xq[xi].q), _mm256_load_si256(xc + xi)); \
                const __m256i s1 = DOTU(u1, _mm256_loadu_si256((const __m256i *)xq[xi + 1].q),          \
                                        _mm256_load_si256(xc + xi + 1));                                \
                acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), mc == 1 ? one0 : _mm256_broadcast_ss(sc + 2 * i), acc0[i]); \
                acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), mc == 1 ? one1 : _mm256_broadcast_ss(sc + 2 * i + 1), \
                                          acc1[i]);                                                     \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < mc; i++) y[(size_t)i * N + n] = hsum(_mm256_add_ps(acc0[i], acc1[i]));      \
    }                                                                                                   \
                                                                                                        \
    ROWS_RUNS(NAME, TARGET)

PAIRS_LOOP(pairs_avx2, AVX2_TARGET, DOTU_AVX2)
PAIRS_LOOP(pairs_vnni, VNNI_TARGET, DOTU_VNNI)

/* AVX-512 VNNI, in tiles of up to 4 weight rows by 4 rows of x: a tile's weight blocks are
 * unpacked once for its 4 rows of x, and each x block is loaded once for its 4 weight rows.
 * Two blocks fill a 512-bit vector (lanes 0-7 the first, 8-15 the second); each pair of a
 * weight row and a row of x keeps its own float32 accumulator, to which every block pair adds
 * its integer sums times d_w * d_x, in block order. So a row of y is computed alike whatever
 * rows surround it in the tile or the batch. Every format's weights go in unsigned, u = w +
 * offset, against x made ready once (pairs_prepare): see the pairs below. */
#define VNNI512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define TILE_W 4
#define TILE_X 4
#define X_CHUNK_BYTES (512 * 1024)

VNNI512_TARGET static inline float sum16(__m512 v) { /* lm_sum16's order */
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

VNNI512_TARGET static inline __m512 pair_scales(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* ---- Q4_0 and Q5_0 repacked in pairs (LM_Q4_0P, LM_Q5_0P), for AVX-512 -------------------
 * The same weights and scales as Q4_0 / Q5_0, laid out so that two blocks unpack into one
 * 512-bit vector in a few instructions (Q5_0 itself takes about twenty, which made its matmul
 * compute-bound at 32 GB/s where Q8_0's reads memory at 60). A pair of blocks:
 *   bytes 0-3    the two blocks' float16 scales;
 *   Q5_0P only: 8 bytes of 64 high bits, bit i the high bit of lane i;
 *   32 bytes of nibbles: byte i's low nibble is lane i (block 0's weight i), its high nibble
 *                lane 32 + i (block 1's weight i).
 * Lane i holds u = nibble (+ 16 * high bit) and the weight is u - 8 (Q4_0) or u - 16 (Q5_0),
 * so a block's products are sum(u * x) - offset * sum(x): VNNI multiplies the unsigned u by the
 * signed x and adds to a start value, and the start value -offset * (x's sums per 4 lanes) is
 * made once per row of x. Each lane's integer sum is the signed products' exactly, and the
 * floating-point steps are the same for every format, so the results are the same bits as for
 * the file's blocks. Q4_0, Q5_0 and Q8_0 go the same way on this tier (unpack_pair): u = w + 8,
 * + 16, + 128. */

VNNI512_TARGET static inline __m512i pair_unsigned(int wtype, const uint8_t *pair) {
    const int hb_bytes = wtype == LM_Q5_0P ? 8 : 0;
    const __m256i nib = _mm256_loadu_si256((const __m256i *)(pair + 4 + hb_bytes));
    const __m512i v = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1),
                                       _mm512_set1_epi8(0x0f));
    if (wtype != LM_Q5_0P) return v;
    uint64_t hb;
    memcpy(&hb, pair + 4, 8);
    return _mm512_mask_add_epi8(v, (__mmask64)hb, v, _mm512_set1_epi8(16));
}

VNNI512_TARGET static inline __m512 pair_scales_w(const uint8_t *pair) {
    uint32_t d2;
    memcpy(&d2, pair, 4);
    const __m256i idx = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_cvtph_ps(_mm256_permutexvar_epi16(idx, _mm256_castsi128_si256(_mm_cvtsi32_si128((int)d2))));
}

/* A row of x made ready for pairs: its 64 bytes, -offset * its sums per 4 lanes, and the two
 * blocks' scales spread over their lanes. */
typedef struct {
    __m512i x, corr;
    __m512 dx;
} xpair_t;

VNNI512_TARGET static void pairs_prepare(int offset, const qblock_t *xq, const float *xd, int M, int nb,
                                         xpair_t *out) {
    const int pairs = (nb + 1) / 2;
    const __m512i off = _mm512_set1_epi8((char)offset);
    for (int m = 0; m < M; m++)
        for (int p = 0; p < pairs; p++) {
            xpair_t *o = out + (size_t)m * pairs + p;
            const size_t b = (size_t)m * nb + 2 * p;
            const int two = 2 * p + 1 < nb; /* an odd last block pairs with zeros */
            o->x = two ? _mm512_loadu_si512((const void *)xq[b].q)
                       : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xq[b].q));
            /* offset * (x's sums per 4 lanes), negated: unsigned offsets by the signed x */
            o->corr = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, o->x));
            o->dx = pair_scales(xd[b], two ? xd[b + 1] : 0.0f);
        }
}

/* Blocks 2p and 2p + 1 of a weight row (any format; the pairs' pair p) as 64 unsigned bytes
 * u = w + unsigned_offset (Q8_0 128, Q4_0 8, Q5_0 16) and their two scales spread over their
 * lanes; an odd last block pairs with zeros (u = offset there, against x's zeros, and a scale
 * of 0). */
VNNI512_TARGET static inline __attribute__((always_inline)) void unpack_pair(int wtype, const uint8_t *row, int p,
                                                                          int nb, __m512i *u, __m512 *dw) {
    const int bb = block_bytes(wtype);
    const uint8_t *b0 = row + (size_t)2 * p * bb;
    if (wtype == LM_Q5_0P || wtype == LM_Q4_0P) {
        *u = pair_unsigned(wtype, b0);
        *dw = pair_scales_w(b0);
        return;
    }
    const int two = 2 * p + 1 < nb;
    const __m256i lo = unpack_avx2(wtype, b0), hi = two ? unpack_avx2(wtype, b0 + bb) : _mm256_setzero_si256();
    *u = _mm512_add_epi8(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                         _mm512_set1_epi8((char)unsigned_offset(wtype)));
    uint16_t h0, h1 = 0;
    memcpy(&h0, b0, 2);
    if (two) memcpy(&h1, b0 + bb, 2);
    /* both halves' float16 scales converted at once, exactly as one at a time */
    *dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)),
                                                  _mm_set1_epi16((short)h1), 1));
}

/* Ask for the lines LM_PREFETCH_BYTES past pair p of a row: the hardware prefetcher alone read
 * the weights from memory at two thirds of the speed on an Intel Xeon (Sapphire Rapids class). */
VNNI512_TARGET static inline __attribute__((always_inline)) void prefetch_pair(int wtype, const uint8_t *row, int p) {
    const int bb = block_bytes(wtype);
    const uint8_t *pair = row + (size_t)2 * p * bb;
    LM_PREFETCH(pair);
    if (2 * bb > 64) LM_PREFETCH(pair + 64);
}

/* Rows n0..n1 against M <= TILE_X prepared rows of x (pairs_prepare with the weights' offset),
 * W read a row at a time, front to back: for a decode step, where each block is used once and
 * a round trip through memory would cost more than it saves. (Four rows side by side are four
 * streams, which the hardware prefetcher follows poorly out of memory: a 151936-row output head
 * ran at 0.4x.) Per pair and row of x one VNNI product started from -offset * x's sums, so its
 * integers are the signed products' exactly, and one fma of them by the two scales' product. */
VNNI512_TARGET static inline __attribute__((always_inline)) void rows_direct(
    int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb, const xpair_t *xp, int M, float *y, int N) {
    const int pairs = (nb + 1) / 2;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        __m512 acc[TILE_X];
        for (int i = 0; i < TILE_X; i++) acc[i] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++) {
            prefetch_pair(wtype, row, p);
            __m512i u;
            __m512 dw;
            unpack_pair(wtype, row, p, nb, &u, &dw);
            for (int i = 0; i < M; i++) {
                const xpair_t *x = xp + (size_t)i * pairs + p;
                const __m512i s32 = _mm512_dpbusd_epi32(x->corr, u, x->x);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_mul_ps(dw, x->dx), acc[i]);
            }
        }
        for (int i = 0; i < M; i++) y[(size_t)i * N + n] = sum16(acc[i]);
    }
}

/* every format and every count of x's rows a constant: with M read at run time the
 * accumulators lived in memory, and a decode step's single row paid for it */
#define DIRECT_M(T)                                                        \
    switch (M) {                                                           \
    case 0: break;                                                         \
    case 1: rows_direct(T, w, row_bytes, n0, n1, nb, xp, 1, y, N); break;  \
    case 2: rows_direct(T, w, row_bytes, n0, n1, nb, xp, 2, y, N); break;  \
    case 3: rows_direct(T, w, row_bytes, n0, n1, nb, xp, 3, y, N); break;  \
    default: rows_direct(T, w, row_bytes, n0, n1, nb, xp, TILE_X, y, N);   \
    }

#define DIRECT_OF(T, NAME)                                                                                     \
    VNNI512_TARGET static void NAME(const uint8_t *w, size_t row_bytes, int n0, int n1, int nb, const xpair_t *xp, \
                                    int M, float *y, int N) {                                                  \
        DIRECT_M(T)                                                                                            \
    }
DIRECT_OF(LM_Q8_0, direct_q8_0)
DIRECT_OF(LM_Q4_0, direct_q4_0)
DIRECT_OF(LM_Q5_0, direct_q5_0)
DIRECT_OF(LM_Q4_0P, direct_q4_0p)
DIRECT_OF(LM_Q5_0P, direct_q5_0p)
#undef DIRECT_OF

VNNI512_TARGET static void rows_direct_any(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,
                                           const xpair_t *xp, int M, float *y, int N) {
    switch (wtype) {
    case LM_Q8_0: direct_q8_0(w, row_bytes, n0, n1, nb, xp, M, y, N); break;
    case LM_Q4_0: direct_q4_0(w, row_bytes, n0, n1, nb, xp, M, y, N); break;
    case LM_Q5_0: direct_q5_0(w, row_bytes, n0, n1, nb, xp, M, y, N); break;
    case LM_Q4_0P: direct_q4_0p(w, row_bytes, n0, n1, nb, xp, M, y, N); break;
    default: direct_q5_0p(w, row_bytes, n0, n1, nb, xp, M, y, N);
    }
}
#undef DIRECT_M

/* A tile's weight rows unpacked (unpack_pair), pair by pair, TILE_W rows a pair. */
typedef struct {
    __m512i u;
    __m512 dw;
} wpair_t;

VNNI512_TARGET static void unpack_tile(int wtype, const uint8_t *const *rows, int nr, int nb, wpair_t *out) {
    const int pairs = (nb + 1) / 2;
    for (int r = 0; r < nr; r++) /* a row at a time, front to back (see rows_direct) */
        for (int p = 0; p < pairs; p++) {
            wpair_t *o = out + (size_t)p * TILE_W + r;
            prefetch_pair(wtype, rows[r], p);
            unpack_pair(wtype, rows[r], p, nb, &o->u, &o->dw);
        }
}

/* nr <= TILE_W unpacked weight rows against mr <= TILE_X prepared rows of x (pairs_prepare with
 * the weights' offset): per pair, row of x and weight row, one VNNI product started from
 * -offset * x's sums, so its integers are the signed products' exactly, then rows_direct's
 * float steps. */
VNNI512_TARGET static inline __attribute__((always_inline)) void tile_vnni512(
    const wpair_t *wt, int nr, int pairs, const xpair_t *xp, int mr, float *y, size_t y_stride, int n) {
    __m512 acc[TILE_W][TILE_X];
    for (int r = 0; r < TILE_W; r++)
        for (int i = 0; i < TILE_X; i++) acc[r][i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const wpair_t *w = wt + (size_t)p * TILE_W;
        for (int i = 0; i < mr; i++) {
            const xpair_t *x = xp + (size_t)i * pairs + p;
            for (int r = 0; r < nr; r++) {
                const __m512i s32 = _mm512_dpbusd_epi32(x->corr, w[r].u, x->x);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_mul_ps(w[r].dw, x->dx), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) y[(size_t)i * y_stride + n + r] = sum16(acc[r][i]);
}

/* M > TILE_X. Returns 0, or -1 when the scratch for the unpacked tile cannot be had. */
VNNI512_TARGET static int rows_vnni512(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,
                                       const qblock_t *xq, const float *xd, int M, float *y, int N) {
    /* M > TILE_X: tiles of TILE_W weight rows, each unpacked once for a chunk of x's rows made
     * ready (pairs_prepare) in at most X_CHUNK_BYTES, which a core's cache holds while the
     * chunk is read once for every tile */
    const int pairs = (nb + 1) / 2;
    int chunk = (int)(X_CHUNK_BYTES / (sizeof(xpair_t) * (size_t)pairs)) / TILE_X * TILE_X;
    if (chunk < TILE_X) chunk = TILE_X;
    if (chunk > M) chunk = M;
    wpair_t *wt = aligned_alloc(64, sizeof(wpair_t) * TILE_W * (size_t)pairs);
    xpair_t *xp = aligned_alloc(64, sizeof(xpair_t) * (size_t)pairs * chunk);
    if (wt == NULL || xp == NULL) {
        free(wt);
        free(xp);
        return -1;
    }
    const int offset = unsigned_offset(wtype);
    for (int c0 = 0; c0 < M; c0 += chunk) {
        const int cn = M - c0 < chunk ? M - c0 : chunk;
        pairs_prepare(offset, xq + (size_t)c0 * nb, xd + (size_t)c0 * nb, cn, nb, xp);
        for (int n = n0; n < n1; n += TILE_W) {
            const int nr = n1 - n < TILE_W ? n1 - n : TILE_W;
            const uint8_t *rows[TILE_W];
            for (int r = 0; r < nr; r++) rows[r] = w + (size_t)(n + r) * row_bytes;
            unpack_tile(wtype, rows, nr, nb, wt); /* once for the chunk's rows of x */
            for (int m0 = 0; m0 < cn; m0 += TILE_X) {
                const int mr = cn - m0 < TILE_X ? cn - m0 : TILE_X;
                const xpair_t *xt = xp + (size_t)m0 * pairs;
                float *yt = y + (size_t)(c0 + m0) * N;
                /* Constant tile sizes, so the accumulators stay in registers. */
                if (nr < TILE_W) tile_vnni512(wt, nr, pairs, xt, mr, yt, N, n);
                else if (mr == TILE_X) tile_vnni512(wt, TILE_W, pairs, xt, TILE_X, yt, N, n);
                else if (mr == 1) tile_vnni512(wt, TILE_W, pairs, xt, 1, yt, N, n);
                else if (mr == 2) tile_vnni512(wt, TILE_W, pairs, xt, 2, yt, N, n);
                else tile_vnni512(wt, TILE_W, pairs, xt, 3, yt, N, n);
            }
        }
    }
    free(wt);
    free(xp);
    return 0;
}

#endif

/* The portable loop, and the definition the vector loops are held to: per block, 8 integer
 * lane sums of 4 products each; lane l of block b accumulates into lane (b % 2) * 8 + l with one
 * fma per block, and the 16 lanes are added in lm_sum16's order. */
static void rows_scalar(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,
                        const qblock_t *xq, const float *xd, int M, float *y, int N) {
    const int bb = block_bytes(wtype);
    int8_t q[QK];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int m = 0; m < M; m++) {
            float acc[16] = {0};
            for (int b = 0; b < nb; b++) {
                const float dw = unpack_block(wtype, row + (size_t)b * bb, q);
                const size_t xi = (size_t)m * nb + b;
                for (int l = 0; l < 8; l++) {
                    int32_t s = 0;
                    for (int t = 4 * l; t < 4 * l + 4; t++) s += (int32_t)q[t] * xq[xi].q[t];
                    acc[(b & 1) * 8 + l] = fmaf((float)s, dw * xd[xi], acc[(b & 1) * 8 + l]);
                }
            }
            y[(size_t)m * N + n] = lm_sum16(acc);
        }
    }
}

/* One row of x to 8-bit blocks, as llama.cpp's quantize_row_q8_0. */
static void quantize_row(const float *x, int nb, qblock_t *q, float *d) {
    for (int b = 0; b < nb; b++) {
        const float *v = x + (size_t)b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float scale = amax / 127.0f, inv = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < QK; j++) q[b].q[j] = (int8_t)nearbyintf(v[j] * inv);
        d[b] = round_to_f16(scale);
    }
}

#ifdef LM_X86
/* quantize_row in AVX2, the same bytes and scales for every finite x: the largest magnitude
 * (a NaN passed over, as fmaxf does), each value times inv rounded to nearest even as
 * nearbyintf rounds, the scale through float16 and back. The portable one calls fmaxf,
 * nearbyintf and a float16 conversion from the C library a value, which made a prompt step's
 * quantizing a few per cent of it, on one thread while the others waited. */
AVX2_TARGET static void quantize_row_avx2(const float *x, int nb, qblock_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < nb; b++) {
        const float *v = x + (size_t)b * QK;
        __m256 a[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            a[k] = _mm256_loadu_ps(v + 8 * k);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, a[k]), m); /* a NaN gives m back */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float scale = amax / 127.0f, inv = amax != 0.0f ? 127.0f / amax : 0.0f;
        __m256i i32[4];
        for (int k = 0; k < 4; k++)
            i32[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a[k], _mm256_set1_ps(inv)),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* 32 values in -127..127: packed to 16 then 8 bits, in order again */
        const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), j16 = _mm256_packs_epi32(i32[2], i32[3]);
        _mm256_storeu_si256((__m256i *)q[b].q, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, j16), order));
        d[b] = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
#endif

typedef struct {
    const float *x;
    int K, nb, M, vector;
    qblock_t *xq;
    float *xd;
} quantize_job_t;

static void quantize_part(void *p, int part, int parts) {
    const quantize_job_t *J = (const quantize_job_t *)p;
    const int m0 = (int)((int64_t)J->M * part / parts), m1 = (int)((int64_t)J->M * (part + 1) / parts);
    for (int m = m0; m < m1; m++) {
        const float *x = J->x + (size_t)m * J->K;
        qblock_t *q = J->xq + (size_t)m * J->nb;
        float *d = J->xd + (size_t)m * J->nb;
#ifdef LM_X86
        if (J->vector) {
            quantize_row_avx2(x, J->nb, q, d);
            continue;
        }
#endif
        quantize_row(x, J->nb, q, d);
    }
}

/* The M rows of x to 8-bit blocks, shared out over the threads where there are enough of them
 * (a prompt step's), on the AVX2 loop wherever the tier has it. */
static void quantize_rows(const float *x, int M, int K, int nb, qblock_t *xq, float *xd, int level, int n_threads) {
    quantize_job_t J = {x, K, nb, M, level >= LM_ISA_AVX2, xq, xd};
    const int threads = (size_t)M * nb >= 1024 ? n_threads : 1;
    lm_pool_run(quantize_part, &J, lm_pool_parts(M, threads), threads);
}

typedef struct {
    int level; /* lm_isa()'s tier, or LM_ISA_SCALAR */
    int wtype;
    const uint8_t *w;
    size_t row_bytes;
    int N, nb, M;
    const qblock_t *xq;
    const float *xd;
    const float *dt; /* tile_scales, for the 256-bit loops */
    const void *xp; /* the rows of x prepared: AVX-512's with M <= TILE_X (xpair_t per pair of
                       blocks), or AVX-VNNI's and AVX2's pairs' start values (__m256i per block) */
    float *y;
    volatile int failed; /* a part could not have its scratch */
} mm_job_t;

static void mm_part(void *p, int part, int parts) {
    mm_job_t *J = (mm_job_t *)p;
    /* Rows in runs of 8, dealt out in order: neighbouring rows stay on one thread. */
    const int runs = (J->N + 7) / 8, per = (runs + parts - 1) / parts;
    const int n0 = part * per * 8, n1 = (part + 1) * per * 8 < J->N ? (part + 1) * per * 8 : J->N;
    if (n0 >= n1) return;
#ifdef LM_X86
    if (J->level == LM_ISA_AVX512VNNI) {
        if (J->xp != NULL) {
            rows_direct_any(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, (const xpair_t *)J->xp, J->M, J->y, J->N);
            return;
        }
        if (rows_vnni512(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N) == 0) return;
        if (J->wtype == LM_Q5_0P || J->wtype == LM_Q4_0P) { /* only the tiles read pairs */
            J->failed = 1;
            return;
        }
        /* no scratch: the untiled loop below needs none */
        rows_avx2(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->dt, NULL, J->M, J->y, J->N);
        return;
    }
    if (J->level == LM_ISA_AVXVNNI || J->level == LM_ISA_AVX2) {
        /* each layout a constant, so the compiler makes a loop for each and no test of the
         * layout is left inside them (Gemma 3's Q8_0 output head at one row of x: 7 % faster) */
        const __m256i *xc = (const __m256i *)J->xp; /* AVX-VNNI's and the pairs' start values, or NULL */
        const int vnni = J->level == LM_ISA_AVXVNNI;
#define CALL_AS(FN, T) FN(T, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->dt, xc, J->M, J->y, J->N)
#define CALL_OF(FN, A, B, C)                                                    \
        switch (J->wtype) {                                                     \
        case A: CALL_AS(FN, A); break;                                          \
        case B: CALL_AS(FN, B); break;                                          \
        default: CALL_AS(FN, C);                                                \
        }
        if (J->wtype == LM_Q5_0P || J->wtype == LM_Q4_0P || J->wtype == LM_Q5_0X) {
            if (vnni) CALL_OF(pairs_vnni, LM_Q5_0X, LM_Q5_0P, LM_Q4_0P) else CALL_OF(pairs_avx2, LM_Q5_0X, LM_Q5_0P, LM_Q4_0P)
        } else if (vnni) {
            CALL_OF(rows_vnni, LM_Q8_0, LM_Q5_0, LM_Q4_0)
        } else {
            CALL_OF(rows_avx2, LM_Q8_0, LM_Q5_0, LM_Q4_0)
        }
#undef CALL_OF
#undef CALL_AS
        return;
    }
#endif
    rows_scalar(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N);
}

int lm_qmatmul(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
               int force_scalar) {
    if (M < 0 || N < 0) return LM_EINVAL;
    if (lm_kquant_bytes(wtype) != 0 || lm_kquant_rows8_type(wtype)) /* kquant.c */
        return lm_qmatmul_k(x, M, K, w, wtype, N, y, n_threads, force_scalar ? LM_ISA_SCALAR : lm_isa());
    if (lm_rows8_type(wtype)) { /* rows8.c, on x's blocks made here */
        if (K % QK != 0 || N % 8 != 0) return LM_EINVAL;
        const int level = force_scalar ? LM_ISA_SCALAR : lm_isa(), nb = K / QK;
        qblock_t *xq = malloc(sizeof(qblock_t) * (size_t)M * nb + 1);
        float *xd = malloc(sizeof(float) * (size_t)M * nb + 1);
        int rc = LM_ENOMEM;
        if (xq != NULL && xd != NULL) {
            quantize_rows(x, M, K, nb, xq, xd, level, n_threads);
            rc = lm_rows8_matmul(level, wtype, w, N, nb, (const int8_t *)xq, xd, M, y, n_threads);
        }
        free(xq);
        free(xd);
        return rc;
    }
    const int bb = block_bytes(wtype);
    if (bb == 0 || K % QK != 0 || M < 0 || N < 0) return LM_EINVAL;
    int level = force_scalar ? LM_ISA_SCALAR : lm_isa();
    /* pairs of blocks, read by the vector loops (lm_repack makes them), not the portable one */
    const int in_pairs = wtype == LM_Q5_0P || wtype == LM_Q4_0P || wtype == LM_Q5_0X;
    if (wtype == LM_Q5_0X && level == LM_ISA_AVX512VNNI) level = LM_ISA_AVX2; /* the 256-bit layout's loop */
    if (in_pairs && (level < LM_ISA_AVX2 || K % (2 * QK) != 0)) return LM_EINVAL;
    const int nb = K / QK;
    qblock_t *xq = malloc(sizeof(qblock_t) * (size_t)M * nb + 1);
    float *xd = malloc(sizeof(float) * (size_t)M * nb + 1);
    void *xp = NULL;
    float *dt = NULL;
    int xp_needed = 0, xc_needed = 0;
    (void)xc_needed;
#ifdef LM_X86
    /* AVX-VNNI, and pairs on AVX2: the unsigned products' start values */
    xc_needed = level == LM_ISA_AVXVNNI || (in_pairs && level == LM_ISA_AVX2);
    xp_needed = (M <= TILE_X && level == LM_ISA_AVX512VNNI) || xc_needed;
    if (xc_needed) xp = aligned_alloc(32, sizeof(__m256i) * ((size_t)M * nb + 1));
    else if (xp_needed) xp = aligned_alloc(64, sizeof(xpair_t) * ((size_t)M * ((nb + 1) / 2) + 1));
#endif
    if (xq == NULL || xd == NULL || (xp_needed && xp == NULL)) {
        free(xq);
        free(xd);
        free(xp);
        return LM_ENOMEM;
    }
    quantize_rows(x, M, K, nb, xq, xd, level, n_threads);
#ifdef LM_X86
    /* the 256-bit loops' scales for tiles of 2 rows of x and more (also AVX-512's fallback when
     * a tile's scratch cannot be had); a decode step's single row reads none, so makes none */
    if (level >= LM_ISA_AVX2 && M > 1 && (dt = tile_scales(xd, M, nb)) == NULL) {
        free(xq);
        free(xd);
        free(xp);
        return LM_ENOMEM;
    }
    if (xc_needed) unsigned_corrections(unsigned_offset(wtype), xq, (size_t)M * nb, (__m256i *)xp);
    else if (xp != NULL) pairs_prepare(unsigned_offset(wtype), xq, xd, M, nb, (xpair_t *)xp);
#endif
    mm_job_t J = {level, wtype, w, (size_t)nb * bb, N, nb, M, xq, xd, dt, xp, y, 0};
    const int threads = (size_t)N * nb < 4096 ? 1 : n_threads; /* too small to share out */
    lm_pool_run(mm_part, &J, lm_pool_parts((N + 7) / 8, threads), threads);
    free(xq);
    free(xd);
    free(dt);
    free(xp);
    return J.failed ? LM_ENOMEM : LM_OK;
}

/* The 64 high bits of a Q5_0 pair (bit i: lane i, lanes 32.. block 1's) in LM_Q5_0X's order
 * (lane 8L + k in bit L of byte k), or back: lm_transpose_bits. */
#define transpose_bits lm_transpose_bits

/* Q4_0 / Q5_0 rows (K a multiple of 64) in pairs (``packed``: Q4_0P, Q5_0P or Q5_0X, see
 * above), or back with reverse: the same bytes rearranged, so a file's blocks can be kept
 * either way. */
int lm_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads) {
    if (lm_rows8_type(packed)) return lm_rows8_repack(w, packed, N, K, out, reverse, n_threads);
    if (lm_kquant_rows8_type(packed)) return lm_kquant_repack(w, packed, N, K, out, reverse, n_threads);
    if ((packed != LM_Q5_0P && packed != LM_Q4_0P && packed != LM_Q5_0X) || K % (2 * QK) != 0 || N < 0)
        return LM_EINVAL;
    const int five = packed != LM_Q4_0P, bb = five ? 22 : 18, qs_at = five ? 6 : 2, nib_at = five ? 12 : 4;
    const size_t pairs = (size_t)N * (K / (2 * QK));
    for (size_t p = 0; p < pairs; p++) {
        const uint8_t *in = w + p * 2 * bb;
        uint8_t *o = out + p * 2 * bb;
        if (!reverse) {
            const uint8_t *b[2] = {in, in + bb};
            memcpy(o, b[0], 2);
            memcpy(o + 2, b[1], 2);
            if (five) {
                uint64_t hb = 0;
                for (int k = 0; k < 2; k++) {
                    uint32_t qh;
                    memcpy(&qh, b[k] + 2, 4);
                    hb |= (uint64_t)qh << (32 * k); /* Q5_0's bit j is weight j's high bit */
                }
                if (packed == LM_Q5_0X) hb = transpose_bits(hb);
                memcpy(o + 4, &hb, 8);
            }
            /* weight i of a block: byte i % 16, nibble i / 16 (two plain loops, which vectorize) */
            const uint8_t *q0 = b[0] + qs_at, *q1 = b[1] + qs_at;
            for (int i = 0; i < 16; i++) o[nib_at + i] = (uint8_t)((q0[i] & 0x0f) | (q1[i] << 4));
            for (int i = 0; i < 16; i++) o[nib_at + 16 + i] = (uint8_t)((q0[i] >> 4) | (q1[i] & 0xf0));
        } else {
            uint8_t *b[2] = {o, o + bb};
            memcpy(b[0], in, 2);
            memcpy(b[1], in + 2, 2);
            for (int k = 0; k < 2; k++) {
                if (five) {
                    uint64_t hb;
                    memcpy(&hb, in + 4, 8);
                    if (packed == LM_Q5_0X) hb = transpose_bits(hb);
                    const uint32_t qh = (uint32_t)(hb >> (32 * k));
                    memcpy(b[k] + 2, &qh, 4);
                }
                memset(b[k] + qs_at, 0, 16);
            }
            for (int i = 0; i < 32; i++)
                for (int k = 0; k < 2; k++) {
                    const uint8_t nib = (in[nib_at + i] >> (4 * k)) & 0x0f;
                    b[k][qs_at + i % 16] |= (uint8_t)(nib << (4 * (i / 16)));
                }
        }
    }
    return LM_OK;
}

/* W's rows as float32, unpacked as the matmul unpacks them (the tests compare this with the
 * gguf package's dequantization). */
int lm_dequantize(const uint8_t *w, int wtype, int N, int K, float *out) {
    const int bb = block_bytes(wtype);
    if (bb == 0 || K % QK != 0) return LM_EINVAL;
    const int nb = K / QK;
    int8_t q[QK];
    for (size_t n = 0; n < (size_t)N; n++)
        for (int b = 0; b < nb; b++) {
            const float d = unpack_block(wtype, w + (n * nb + b) * bb, q);
            float *o = out + n * K + (size_t)b * QK;
            for (int j = 0; j < QK; j++) o[j] = d * q[j];
        }
    return LM_OK;
}
