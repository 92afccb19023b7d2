/* y = x W^T with W in a GGUF block format, read in place: the torch runner's matmul for the
 * tensors a file stores as Q4_0, Q5_0 or Q8_0 (blocks of 32 weights with a float16 scale d).
 *
 * As llama.cpp computes them: each row of x is quantized to 8 bits in blocks of 32 (scale
 * max|x| / 127, kept as float16; values rounded to nearest even), the weights are unpacked to
 * signed 8-bit integers (Q4_0: nibble - 8; Q5_0: nibble + 16 * high bit - 16; Q8_0 as
 * stored), each block's products are summed in integers and scaled once by d_w * d_x.
 *
 * Rows of W are shared out to the thread pool. Where the CPU has AVX-512 VNNI, tiles of 4 rows
 * of W by 4 rows of x (below); elsewhere a row of W at a time against 4 rows of x.
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

int lm_block_bytes(int wtype) {
    switch (wtype) {
    case LM_Q4_0: return 18;
    case LM_Q5_0: return 22;
    case LM_Q8_0: return 34;
    default: return 0;
    }
}

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
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

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

AVX2_TARGET static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define ROWS_KERNEL(NAME, TARGET, DOT)                                                                  \
    TARGET static void NAME(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,     \
                            const qblock_t *xq, const float *xd, int M, float *y, int N) {              \
        const int bb = lm_block_bytes(wtype);                                                           \
        for (int n = n0; n < n1; n++) {                                                                 \
            const uint8_t *row = w + (size_t)n * row_bytes;                                             \
            for (int m0 = 0; m0 < M; m0 += 4) {                                                         \
                const int mc = M - m0 < 4 ? M - m0 : 4;                                                 \
                __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),         \
                                 _mm256_setzero_ps()};                                                  \
                for (int b = 0; b < nb; b++) {                                                          \
                    const uint8_t *blk = row + (size_t)b * bb;                                          \
                    uint16_t dh;                                                                        \
                    memcpy(&dh, blk, 2);                                                                \
                    const float dw = _cvtsh_ss(dh);                                                     \
                    const __m256i q = unpack_avx2(wtype, blk);                                          \
                    const __m256i aq = _mm256_sign_epi8(q, q);                                          \
                    for (int i = 0; i < mc; i++) {                                                      \
                        const size_t xi = (size_t)(m0 + i) * nb + b;                                    \
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)xq[xi].q);               \
                        const __m256i sx = _mm256_sign_epi8(xv, q);                                     \
                        const __m256i s32 = DOT(aq, sx);                                                \
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(dw * xd[xi]), acc[i]); \
                    }                                                                                   \
                }                                                                                       \
                for (int i = 0; i < mc; i++) y[(size_t)(m0 + i) * N + n] = hsum(acc[i]);                \
            }                                                                                           \
        }                                                                                               \
    }

AVX2_TARGET static inline __m256i dot_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
VNNI_TARGET static inline __m256i dot_vnni(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

ROWS_KERNEL(rows_avx2, AVX2_TARGET, dot_avx2)
ROWS_KERNEL(rows_vnni, VNNI_TARGET, dot_vnni)

/* AVX-512 VNNI, in tiles of up to 4 weight rows by 4 rows of x: a tile's weight blocks are
 * unpacked once for its 4 rows of x, and each x block is loaded once for its 4 weight rows.
 * Two blocks fill a 512-bit vector (lanes 0-7 the first, 8-15 the second); each pair of a
 * weight row and a row of x keeps its own float32 accumulator, to which every block pair adds
 * its integer sums times d_w * d_x, in block order. So a row of y is computed alike whatever
 * rows surround it in the tile or the batch. */
#define VNNI512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define TILE_W 4
#define TILE_X 4

VNNI512_TARGET static inline __m512 pair_scales(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* A tile's weight rows unpacked, pair of blocks by pair: |w| as unsigned bytes, w's signs, and
 * the two scales; an odd last block pairs with zeros. */
typedef struct {
    __m512i aw;
    __m512 dw;
    __mmask64 neg;
} wpair_t;

VNNI512_TARGET static void unpack_tile(int wtype, const uint8_t *const *rows, int nr, int nb, wpair_t *out) {
    const int bb = lm_block_bytes(wtype), pairs = (nb + 1) / 2;
    for (int r = 0; r < nr; r++) /* a row at a time, front to back (see rows_vnni512) */
        for (int p = 0; p < pairs; p++) {
            const uint8_t *b0 = rows[r] + (size_t)2 * p * bb;
            const int two = 2 * p + 1 < nb;
            const __m256i lo = unpack_avx2(wtype, b0), hi = two ? unpack_avx2(wtype, b0 + bb) : _mm256_setzero_si256();
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            uint16_t h0, h1 = 0;
            memcpy(&h0, b0, 2);
            if (two) memcpy(&h1, b0 + bb, 2);
            wpair_t *o = out + (size_t)p * TILE_W + r;
            o->aw = _mm512_abs_epi8(w);
            o->neg = _mm512_movepi8_mask(w);
            o->dw = pair_scales(_cvtsh_ss(h0), two ? _cvtsh_ss(h1) : 0.0f);
        }
}

VNNI512_TARGET static inline __attribute__((always_inline)) void tile_vnni512(
    const wpair_t *wt, int nr, int nb, const qblock_t *const *xq, const float *const *xd, int mr, float *y,
    size_t y_stride, int n) {
    __m512 acc[TILE_W][TILE_X];
    for (int r = 0; r < TILE_W; r++)
        for (int i = 0; i < TILE_X; i++) acc[r][i] = _mm512_setzero_ps();
    const int pairs = (nb + 1) / 2;
    for (int p = 0; p < pairs; p++) {
        const int b = 2 * p, two = b + 1 < nb;
        const wpair_t *w = wt + (size_t)p * TILE_W;
        for (int i = 0; i < mr; i++) {
            /* an odd last block: 32 bytes of x, so nothing past the row is read */
            const __m512i xv = two ? _mm512_loadu_si512((const void *)xq[i][b].q)
                                   : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xq[i][b].q));
            const __m512 dx = pair_scales(xd[i][b], two ? xd[i][b + 1] : 0.0f);
            for (int r = 0; r < nr; r++) {
                /* |w| times x with w's signs: unsigned by signed bytes, as VNNI multiplies. */
                const __m512i sx = _mm512_mask_sub_epi8(xv, w[r].neg, _mm512_setzero_si512(), xv);
                const __m512i s32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r].aw, sx);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_mul_ps(w[r].dw, dx), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) y[(size_t)i * y_stride + n + r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* The same tile with its weights unpacked as it goes: for M of at most TILE_X (a decode step),
 * where each block is used once and a round trip through memory would cost more than it
 * saves. The arithmetic is tile_vnni512's, operation for operation. */
VNNI512_TARGET static inline __attribute__((always_inline)) void tile_direct(
    int wtype, const uint8_t *const *rows, int nr, int nb, const qblock_t *const *xq, const float *const *xd,
    int mr, float *y, size_t y_stride, int n) {
    const int bb = lm_block_bytes(wtype);
    __m512 acc[TILE_W][TILE_X];
    for (int r = 0; r < TILE_W; r++)
        for (int i = 0; i < TILE_X; i++) acc[r][i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        __m512i aw[TILE_W];
        __m512 dw[TILE_W];
        __mmask64 neg[TILE_W];
        for (int r = 0; r < nr; r++) {
            const uint8_t *b0 = rows[r] + (size_t)b * bb;
            const __m256i lo = unpack_avx2(wtype, b0), hi = two ? unpack_avx2(wtype, b0 + bb) : _mm256_setzero_si256();
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            uint16_t h0, h1 = 0;
            memcpy(&h0, b0, 2);
            if (two) memcpy(&h1, b0 + bb, 2);
            aw[r] = _mm512_abs_epi8(w);
            neg[r] = _mm512_movepi8_mask(w);
            dw[r] = pair_scales(_cvtsh_ss(h0), two ? _cvtsh_ss(h1) : 0.0f);
        }
        for (int i = 0; i < mr; i++) {
            const __m512i xv = two ? _mm512_loadu_si512((const void *)xq[i][b].q)
                                   : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xq[i][b].q));
            const __m512 dx = pair_scales(xd[i][b], two ? xd[i][b + 1] : 0.0f);
            for (int r = 0; r < nr; r++) {
                const __m512i sx = _mm512_mask_sub_epi8(xv, neg[r], _mm512_setzero_si512(), xv);
                const __m512i s32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[r], sx);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_mul_ps(dw[r], dx), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < mr; i++) y[(size_t)i * y_stride + n + r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* Returns 0, or -1 when the scratch for the unpacked tile cannot be had. */
VNNI512_TARGET static int rows_vnni512(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,
                                       const qblock_t *xq, const float *xd, int M, float *y, int N) {
    wpair_t *wt = NULL;
    if (M > TILE_X && (wt = aligned_alloc(64, sizeof(wpair_t) * TILE_W * (size_t)((nb + 1) / 2))) == NULL) return -1;
    if (wt == NULL) { /* M <= TILE_X: one tile of x, and W read a row at a time, front to back */
        /* (Four rows side by side are four streams, which the hardware prefetcher follows
         * poorly out of memory: a 151936-row output head ran at 0.4x.) */
        const qblock_t *xs[TILE_X];
        const float *ds[TILE_X];
        for (int i = 0; i < TILE_X; i++) {
            xs[i] = xq + (size_t)(i < M ? i : 0) * nb;
            ds[i] = xd + (size_t)(i < M ? i : 0) * nb;
        }
        for (int n = n0; n < n1; n++) {
            const uint8_t *row[1] = {w + (size_t)n * row_bytes};
            switch (M) {
            case 1: tile_direct(wtype, row, 1, nb, xs, ds, 1, y, N, n); break;
            case 2: tile_direct(wtype, row, 1, nb, xs, ds, 2, y, N, n); break;
            case 3: tile_direct(wtype, row, 1, nb, xs, ds, 3, y, N, n); break;
            default: tile_direct(wtype, row, 1, nb, xs, ds, M, y, N, n);
            }
        }
        return 0;
    }
    for (int n = n0; n < n1; n += TILE_W) {
        const int nr = n1 - n < TILE_W ? n1 - n : TILE_W;
        const uint8_t *rows[TILE_W];
        for (int r = 0; r < nr; r++) rows[r] = w + (size_t)(n + r) * row_bytes;
        unpack_tile(wtype, rows, nr, nb, wt); /* once for all M rows of x */
        for (int m0 = 0; m0 < M; m0 += TILE_X) {
            const int mr = M - m0 < TILE_X ? M - m0 : TILE_X;
            const qblock_t *xs[TILE_X];
            const float *ds[TILE_X];
            for (int i = 0; i < TILE_X; i++) {
                const int m = m0 + (i < mr ? i : 0);
                xs[i] = xq + (size_t)m * nb;
                ds[i] = xd + (size_t)m * nb;
            }
            float *yt = y + (size_t)m0 * N;
            /* Constant tile sizes for the common cases, so the accumulators stay in registers. */
            if (nr == TILE_W && mr == TILE_X) tile_vnni512(wt, TILE_W, nb, xs, ds, TILE_X, yt, N, n);
            else if (nr == TILE_W && mr == 1) tile_vnni512(wt, TILE_W, nb, xs, ds, 1, yt, N, n);
            else tile_vnni512(wt, nr, nb, xs, ds, mr, yt, N, n);
        }
    }
    free(wt);
    return 0;
}

static int cpu_level = -1; /* 0 plain, 1 AVX2, 2 AVX-512 VNNI (256-bit), 3 AVX-512 VNNI tiles */
#endif

static void rows_scalar(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nb,
                        const qblock_t *xq, const float *xd, int M, float *y, int N) {
    const int bb = lm_block_bytes(wtype);
    int8_t q[QK];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const float dw = unpack_block(wtype, row + (size_t)b * bb, q);
                const size_t xi = (size_t)m * nb + b;
                int32_t s = 0;
                for (int j = 0; j < QK; j++) s += (int32_t)q[j] * xq[xi].q[j];
                acc += (float)s * (dw * xd[xi]);
            }
            y[(size_t)m * N + n] = acc;
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

typedef struct {
    int level; /* cpu_level's, or 0 */
    int wtype;
    const uint8_t *w;
    size_t row_bytes;
    int N, nb, M;
    const qblock_t *xq;
    const float *xd;
    float *y;
} mm_job_t;

static void mm_part(void *p, int part, int parts) {
    const mm_job_t *J = (const mm_job_t *)p;
    /* Rows in runs of 8, dealt out in order: neighbouring rows stay on one thread. */
    const int runs = (J->N + 7) / 8, per = (runs + parts - 1) / parts;
    const int n0 = part * per * 8, n1 = (part + 1) * per * 8 < J->N ? (part + 1) * per * 8 : J->N;
    if (n0 >= n1) return;
#ifdef LM_X86
    if (J->level == 3) {
        if (rows_vnni512(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N) == 0) return;
        /* no scratch: the untiled loop below needs none */
        rows_vnni(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N);
        return;
    }
    if (J->level == 2) { rows_vnni(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N); return; }
    if (J->level == 1) { rows_avx2(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N); return; }
#endif
    rows_scalar(J->wtype, J->w, J->row_bytes, n0, n1, J->nb, J->xq, J->xd, J->M, J->y, J->N);
}

int lm_qmatmul(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
               int force_scalar) {
    const int bb = lm_block_bytes(wtype);
    if (bb == 0 || K % QK != 0 || M < 0 || N < 0) return LM_EINVAL;
#ifdef LM_X86
    if (cpu_level < 0) {
        __builtin_cpu_init();
        const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        const int vnni = avx2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
        const int vnni512 = vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
        cpu_level = vnni512 ? 3 : vnni ? 2 : avx2 ? 1 : 0;
    }
    const int level = force_scalar ? 0 : cpu_level;
#else
    const int level = 0;
    (void)force_scalar;
#endif
    const int nb = K / QK;
    qblock_t *xq = malloc(sizeof(qblock_t) * (size_t)M * nb + 1);
    float *xd = malloc(sizeof(float) * (size_t)M * nb + 1);
    if (xq == NULL || xd == NULL) {
        free(xq);
        free(xd);
        return LM_ENOMEM;
    }
    for (int m = 0; m < M; m++) quantize_row(x + (size_t)m * K, nb, xq + (size_t)m * nb, xd + (size_t)m * nb);
    mm_job_t J = {level, wtype, w, (size_t)nb * bb, N, nb, M, xq, xd, y};
    int parts = n_threads < 1 ? 1 : n_threads;
    if ((size_t)N * nb < 4096) parts = 1; /* too small to share out */
    lm_pool_run(mm_part, &J, parts);
    free(xq);
    free(xd);
    return LM_OK;
}

/* W's rows as float32, unpacked as the matmul unpacks them (the tests compare this with the
 * gguf package's dequantization). */
int lm_dequantize(const uint8_t *w, int wtype, int N, int K, float *out) {
    const int bb = lm_block_bytes(wtype);
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
