/* y = x W^T with W in K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each), read in
 * place, against x quantized as llama.cpp's Q8_K: per 256 values one float scale d = max /
 * -127 (max: the value of largest magnitude), values round(x / d) capped at 127.
 *   Q4_K (144 bytes): d, dmin, scales[12] (8 scales and 8 mins of 6 bits, one per 32
 *     weights), qs[128] nibbles. Weight = d * scale * q - dmin * min, q in 0..15.
 *   Q5_K (176 bytes): Q4_K's d, dmin and scales, qh[32] (bit p of byte l: weight 32p + l's
 *     fifth bit), qs[128]. q in 0..31.
 *   Q6_K (210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8 (one per 16
 *     weights), d. Weight = d * scale * (q - 32), q in 0..63.
 *
 * One result on every tier, bit for bit. A super-block's 256 products are summed in 16
 * integer lanes: lane (p % 2) * 8 + l holds, over the four pieces p of that parity, the
 * sub-block scale times the sum of the 4 products 32p + 4l .. 32p + 4l + 3 (Q6_K: of q - 32).
 * Integer sums are exact, so every tier has the same 16 integers. The float part is one fixed
 * order: lane i accumulates fma(lane sum, d_w * d_x, acc_i) super-block by super-block, and
 * the 16 lanes are added as lm_sum16 adds them (Q4_K and Q5_K: less the 8 mins times x's sums
 * per 32, accumulated and added alike). The AVX-512 VNNI loops hold the 16 lanes in one
 * vector, the AVX2 ones in two (the even and the odd pieces), the scalar one in an array.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "localllm_native.h"

#define QKK 256

typedef struct {
    int8_t q[QKK];         /* x's values */
    int32_t corr[QKK / 4]; /* -32 * the sums of each 4 values (Q6_K's offset, for VNNI) */
    int16_t q32[QKK / 2];  /* 32 * the sums of each 2 values (Q6_K's offset, for AVX2's maddubs) */
    int32_t bsum32[8];     /* sums of each 32 values (the mins of Q4_K and Q5_K) */
    int16_t bs32h[8];      /* the same in 16 bits, and the sums of each 16 (Q6_K's offset), */
    int16_t bs16[16];      /* for the interleaved rows' madd by pairs */
    float d;
    int32_t pad[11];
} xk_t; /* 896 bytes, a multiple of 64 */

static inline int kquant_bytes(int wtype) { /* inlined, where lm_kquant_bytes is not (qmatmul.c's block_bytes) */
    switch (wtype) {
    case LM_Q4_K: return 144;
    case LM_Q5_K: return 176;
    case LM_Q6_K: return 210;
    default: return 0;
    }
}

int lm_kquant_bytes(int wtype) { return kquant_bytes(wtype); }

static inline int nearest_int(float f) { /* llama.cpp's: to nearest, ties to even */
    float v = f + 12582912.f;
    int i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* One row of x (K values) as Q8_K super-blocks, as quantize_row_q8_K_ref. */
static void quantize_row_k(const float *x, int nsb, xk_t *out) {
    for (int s = 0; s < nsb; s++, x += QKK) {
        xk_t *o = out + s;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QKK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(o, 0, sizeof(*o));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QKK; j++) {
            const int v = nearest_int(iscale * x[j]);
            o->q[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QKK / 4; j++)
            o->corr[j] = -32 * (o->q[4 * j] + o->q[4 * j + 1] + o->q[4 * j + 2] + o->q[4 * j + 3]);
        for (int j = 0; j < QKK / 2; j++) o->q32[j] = (int16_t)(32 * (o->q[2 * j] + o->q[2 * j + 1]));
        for (int j = 0; j < 8; j++) {
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) sum += o->q[32 * j + i];
            o->bsum32[j] = sum;
            o->bs32h[j] = (int16_t)sum; /* |sum| <= 32 * 127 */
        }
        for (int j = 0; j < 16; j++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) sum += o->q[16 * j + i];
            o->bs16[j] = (int16_t)sum;
        }
        o->d = 1.0f / iscale;
    }
}

typedef struct {
    const float *x;
    int K, nsb, M;
    xk_t *xk;
} quantize_k_job_t;

static void quantize_k_part(void *p, int part, int parts) {
    const quantize_k_job_t *J = (const quantize_k_job_t *)p;
    const int m0 = (int)((int64_t)J->M * part / parts), m1 = (int)((int64_t)J->M * (part + 1) / parts);
    for (int m = m0; m < m1; m++) quantize_row_k(J->x + (size_t)m * J->K, J->nsb, J->xk + (size_t)m * J->nsb);
}

/* The M rows of x, shared out over the threads where there are enough of them (a prompt
 * step's: on one thread, the others waited for it). */
static void quantize_rows_k(const float *x, int M, int K, int nsb, xk_t *xk, int n_threads) {
    quantize_k_job_t J = {x, K, nsb, M, xk};
    const int threads = (size_t)M * nsb >= 128 ? n_threads : 1;
    lm_pool_run(quantize_k_part, &J, lm_pool_parts(M, threads), threads);
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins as 8 scale bytes then 8 min bytes. */
static inline void k4_scales(const uint8_t *packed, uint32_t out[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(out, packed, 12);
    out[3] = ((out[2] >> 4) & kmask2) | (((out[1] >> 6) & kmask3) << 4);
    const uint32_t aux = out[1] & kmask1;
    out[1] = (out[2] & kmask2) | (((out[0] >> 6) & kmask3) << 4);
    out[2] = aux;
    out[0] &= kmask1;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lm_half_to_float(h);
}

/* ---- the portable loop: the definition the vector loops are held to --------------------- */

/* A super-block's 256 values q (Q6_K: q - 32), the scale of each 16 weights, and the 8 mins. */
static void unpack_super(int wtype, const uint8_t *b, int8_t q[QKK], int32_t sc16[16], int32_t mins[8]) {
    if (wtype == LM_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t hb = qh[32 * h + l], lo = ql[64 * h + l], hi = ql[64 * h + 32 + l];
                q[128 * h + l] = (int8_t)(((lo & 0x0f) | ((hb & 3) << 4)) - 32);
                q[128 * h + 32 + l] = (int8_t)(((hi & 0x0f) | (((hb >> 2) & 3) << 4)) - 32);
                q[128 * h + 64 + l] = (int8_t)(((lo >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                q[128 * h + 96 + l] = (int8_t)(((hi >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        for (int j = 0; j < 16; j++) sc16[j] = (int8_t)b[192 + j];
        for (int j = 0; j < 8; j++) mins[j] = 0;
        return;
    }
    uint32_t sm[4];
    k4_scales(b + 4, sm);
    const uint8_t *s8 = (const uint8_t *)sm, *qh = b + 16, *qs = b + (wtype == LM_Q5_K ? 48 : 16);
    for (int p = 0; p < 8; p++) {
        sc16[2 * p] = sc16[2 * p + 1] = s8[p];
        mins[p] = s8[8 + p];
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = qs[32 * (p / 2) + l];
            int v = p % 2 ? byte >> 4 : byte & 0x0f;
            if (wtype == LM_Q5_K) v |= ((qh[l] >> p) & 1) << 4;
            q[32 * p + l] = (int8_t)v;
        }
    }
}

static void rows_scalar(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nsb, const xk_t *xk,
                        int M, float *y, int N) {
    const int sb = kquant_bytes(wtype);
    int8_t q[QKK];
    int32_t sc16[16], mins[8];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int m = 0; m < M; m++) {
            float acc[16] = {0}, accm[8] = {0};
            for (int s = 0; s < nsb; s++) {
                const uint8_t *b = row + (size_t)s * sb;
                const xk_t *x = xk + (size_t)m * nsb + s;
                unpack_super(wtype, b, q, sc16, mins);
                int32_t lane[16] = {0};
                for (int p = 0; p < 8; p++)
                    for (int l = 0; l < 8; l++) {
                        const int j = 32 * p + 4 * l;
                        int32_t dot = 0;
                        for (int t = 0; t < 4; t++) dot += (int32_t)q[j + t] * x->q[j + t];
                        lane[(p % 2) * 8 + l] += dot * sc16[j / 16];
                    }
                const float dw = f16_at(wtype == LM_Q6_K ? b + 208 : b);
                for (int i = 0; i < 16; i++) acc[i] = fmaf((float)lane[i], dw * x->d, acc[i]);
                if (wtype != LM_Q6_K) {
                    const float dmin = f16_at(b + 2);
                    for (int i = 0; i < 8; i++) accm[i] = fmaf((float)(mins[i] * x->bsum32[i]), dmin * x->d, accm[i]);
                }
            }
            y[(size_t)m * N + n] = lm_sum16(acc) - lm_sum8(accm);
        }
    }
}

/* ---- x86-64 ---------------------------------------------------------------------------- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LM_X86 1
#define TILE_X 4 /* rows of x at a time */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))

AVX2_TARGET static inline float sum8_avx2(__m256 v) { /* lm_sum8's order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Piece p (weights 32p .. 32p + 31) of a super-block as 32 unsigned bytes (Q6_K: q, not
 * q - 32), and its scales as 16-bit lanes (two per 16 weights, for madd). */
AVX2_TARGET static inline __m256i piece_avx2(int wtype, const uint8_t *b, int p) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    if (wtype == LM_Q6_K) {
        const int h = p / 4, k = p % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (k & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), m0f);
        /* bits 2k, 2k + 1 of qh to bits 4-5 */
        __m256i hi;
        switch (k) {
        case 0: hi = _mm256_slli_epi16(qh, 4); break;
        case 1: hi = _mm256_slli_epi16(qh, 2); break;
        case 2: hi = qh; break;
        default: hi = _mm256_srli_epi16(qh, 2);
        }
        return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    }
    const uint8_t *qs = b + (wtype == LM_Q5_K ? 48 : 16) + 32 * (p / 2);
    const __m256i nib = _mm256_loadu_si256((const __m256i *)qs);
    __m256i u = _mm256_and_si256(p % 2 ? _mm256_srli_epi16(nib, 4) : nib, m0f);
    if (wtype == LM_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(p)), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
    }
    return u;
}

/* A super-block's scales as 16-bit lanes, once for its 8 pieces: Q6_K's 16 (one per 16 weights)
 * with the even ones in the low half and the odd ones in the high half, Q4_K's and Q5_K's 8 (one
 * per 32) in both halves. */
AVX2_TARGET static inline __m256i super_scales(int wtype, const uint8_t *b, const uint8_t *s8) {
    if (wtype == LM_Q6_K) {
        const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)), evens_odds));
    }
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)s8)));
}

/* Piece p's scales for madd, one shuffle of super_scales: Q6_K's 16-bit lanes 0-7 the scale of
 * weights 32p..32p+15 and lanes 8-15 of the next 16; Q4_K's and Q5_K's one scale in every lane
 * (a broadcast from a byte in memory cost three instructions, Q6_K's pair seven). */
AVX2_TARGET static inline __m256i piece_scales(__m256i scales, int p) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(2 * p | (2 * p + 1) << 8)));
}

#define KQ_ROW(FN, T, MR) FN(T, row, nsb, xs, MR, y, N, n)
/* every tile size a constant (a loop over a variable count kept its sums in memory: two rows
 * of x, a draft's check, cost as much as four) */
#define KQ_ROWS(FN, T)                   \
    do {                                 \
        switch (mr) {                    \
        case 1: KQ_ROW(FN, T, 1); break; \
        case 2: KQ_ROW(FN, T, 2); break; \
        case 3: KQ_ROW(FN, T, 3); break; \
        default: KQ_ROW(FN, T, TILE_X);  \
        }                                \
    } while (0)

/* The AVX2 and AVX-VNNI loops, compiled once for each (KQ_LOOPS).
 * kq_row: row n of W against mr <= TILE_X rows of x (xs[i]: row i's super-blocks), each piece
 * unpacked once for the mr rows. (Unpacking runs of rows once into scratch for all the rows of
 * x was tried: within 10 % either way from 8 to 128 rows.) maddubs' 16-bit pair sums cannot
 * overflow (q <= 63, |x| <= 127; Q6_K's 32 * x's pair sums are x's own, made once per row of
 * x), and ACC, a madd by the scales and an add (AVX2) or one vpdpwssd (AVX-VNNI, 8-10 % faster
 * on Q4_K at 8 rows of x), gives each lane's scale times its 4 products, the same integers.
 * rows: rows n0..n1 of W against all M rows of x, W in runs of ROWS_RUN rows, each run against
 * the rows of x TILE_X at a time, so that a run is read from memory once for all of them (a row
 * of W at a time against every tile read W once per tile, M / 4 times over: a few per cent
 * slower here, where the shared cache held them). Q6_K takes the rows of x Q6T at a time: on
 * AVX2 2, since with 4 its sums and offsets did not fit the 16 vector registers and the loop ran
 * 10 % slower a row (a Zen 2 core); on AVX-VNNI, where vpdpwssd needs no temporary, 4, 16 %
 * faster at 8 rows of x than 2 (an Intel Xeon forced to the tier). */
#define ROWS_RUN 16
#define KQ_LOOPS(SUF, TARGET, ACC, Q6T)                                                                                       \
TARGET static inline __attribute__((always_inline)) void kq_row_##SUF(                                                        \
    int wtype, const uint8_t *row, int nsb, const xk_t *const *xs, int mr, float *y, size_t y_stride, int n) {                \
    const int sb = kquant_bytes(wtype), six = wtype == LM_Q6_K;                                                               \
    __m256 acc[2][TILE_X], accm[TILE_X];                                                                                      \
    for (int i = 0; i < TILE_X; i++) acc[0][i] = acc[1][i] = accm[i] = _mm256_setzero_ps();                                   \
    for (int s = 0; s < nsb; s++) {                                                                                           \
        const uint8_t *b = row + (size_t)s * sb;                                                                              \
        for (int o = 0; o < sb; o += 64) LM_PREFETCH(b + o);                                                                  \
        uint32_t sm[4] = {0};                                                                                                 \
        if (!six) k4_scales(b + 4, sm);                                                                                       \
        const uint8_t *s8 = (const uint8_t *)sm;                                                                              \
        const float dw = f16_at(six ? b + 208 : b);                                                                           \
        const __m256i scales = super_scales(wtype, b, s8);                                                                    \
        for (int par = 0; par < 2; par++) {                                                                                   \
            __m256i isum[TILE_X];                                                                                             \
            for (int i = 0; i < TILE_X; i++) isum[i] = _mm256_setzero_si256();                                                \
            for (int c = 0; c < 4; c++) {                                                                                     \
                const int p = 2 * c + par;                                                                                    \
                const __m256i u = piece_avx2(wtype, b, p), scale = piece_scales(scales, p);                                   \
                for (int i = 0; i < mr; i++) {                                                                                \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs[i][s].q + 32 * p));                            \
                    __m256i p16 = _mm256_maddubs_epi16(u, xv);                                                                \
                    if (six) p16 = _mm256_sub_epi16(p16, _mm256_loadu_si256((const __m256i *)(xs[i][s].q32 + 16 * p)));       \
                    isum[i] = ACC(isum[i], p16, scale);                                                                       \
                }                                                                                                             \
            }                                                                                                                 \
            for (int i = 0; i < mr; i++)                                                                                      \
                acc[par][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(dw * xs[i][s].d), acc[par][i]);     \
        }                                                                                                                     \
        if (!six) {                                                                                                           \
            const float dmin = f16_at(b + 2);                                                                                 \
            const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s8 + 8)));                            \
            for (int i = 0; i < mr; i++) {                                                                                    \
                const __m256i mb = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)xs[i][s].bsum32));            \
                accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mb), _mm256_set1_ps(dmin * xs[i][s].d), accm[i]);                \
            }                                                                                                                 \
        }                                                                                                                     \
    }                                                                                                                         \
    for (int i = 0; i < mr; i++) /* lm_sum16: lane i with lane i + 8 first */                                                 \
        y[(size_t)i * y_stride + n] = sum8_avx2(_mm256_add_ps(acc[0][i], acc[1][i])) - sum8_avx2(accm[i]);                    \
}                                                                                                                             \
                                                                                                                              \
TARGET static void row_##SUF(int wtype, const uint8_t *row, int n, int nsb, const xk_t *const *xs, int mr,                    \
                                 float *y, int N) {                                                                           \
    switch (wtype) {                                                                                                          \
    case LM_Q4_K: KQ_ROWS(kq_row_##SUF, LM_Q4_K); break;                                                                      \
    case LM_Q5_K: KQ_ROWS(kq_row_##SUF, LM_Q5_K); break;                                                                      \
    default: KQ_ROWS(kq_row_##SUF, LM_Q6_K);                                                                                  \
    }                                                                                                                         \
}                                                                                                                             \
                                                                                                                              \
TARGET static void rows_##SUF(int wtype, const uint8_t *w, size_t row_bytes, int n0, int n1, int nsb,                         \
                                  const xk_t *xk, int M, float *y, int N) {                                                   \
    const int tile = wtype == LM_Q6_K ? Q6T : TILE_X;                                                                              \
    for (int r0 = n0; r0 < n1; r0 += ROWS_RUN) {                                                                              \
        const int r1 = n1 - r0 < ROWS_RUN ? n1 : r0 + ROWS_RUN;                                                               \
        for (int m0 = 0; m0 < M; m0 += tile) {                                                                                \
            const int mr = M - m0 < tile ? M - m0 : tile;                                                                     \
            const xk_t *xs[TILE_X];                                                                                           \
            for (int i = 0; i < TILE_X; i++) xs[i] = xk + (size_t)(m0 + (i < mr ? i : 0)) * nsb;                              \
            for (int n = r0; n < r1; n++) row_##SUF(wtype, w + (size_t)n * row_bytes, n, nsb, xs, mr, y + (size_t)m0 * N, N); \
        }                                                                                                                     \
    }                                                                                                                         \
}

/* AVX2: madd by the scales, then an add; AVX-VNNI: the two in one vpdpwssd (the same integers) */
#define ACC_AVX2(isum, p16, scale) _mm256_add_epi32(isum, _mm256_madd_epi16(p16, scale))
#define ACC_VNNI(isum, p16, scale) _mm256_dpwssd_avx_epi32(isum, p16, scale)
KQ_LOOPS(avx2, AVX2_TARGET, ACC_AVX2, 2)
KQ_LOOPS(vnni, VNNI_TARGET, ACC_VNNI, 4)

/* ---- AVX-512 VNNI: Q4_K and Q6_K with the 16 lanes in one vector ------------------------ */
#define VNNI512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

VNNI512_TARGET static inline float sum16_512(__m512 v) { /* lm_sum16's order */
    return sum8_avx2(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

VNNI512_TARGET static inline __attribute__((always_inline)) void q6k_rows_512(
    const uint8_t *w, size_t row_bytes, int n0, int n1, int nsb, const xk_t *const *xs, int mr, float *y,
    size_t y_stride) {
    const __m512i m0f = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* high bits to bits 4-5: lanes 0-31 from bits 0-1 (0 and 2 for the second half) and
     * lanes 32-63 from bits 2-3 (4 and 6) */
    const __m512i cnt_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i cnt_b = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    __m512i idx[4]; /* chunk c's 16 lanes: sub-blocks 4c .. 4c + 3, four lanes each */
    for (int c = 0; c < 4; c++)
        idx[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                   4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        __m512 acc[TILE_X];
        for (int i = 0; i < TILE_X; i++) acc[i] = _mm512_setzero_ps();
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * 210;
            for (int o = 0; o < 210; o += 64) LM_PREFETCH(b + o);
            const float dw = f16_at(b + 208);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
            __m512i isum[TILE_X];
            for (int i = 0; i < TILE_X; i++) isum[i] = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                const __m512i u[2] = {
                    _mm512_or_si512(_mm512_and_si512(ql, m0f), _mm512_and_si512(_mm512_sllv_epi16(qh, cnt_a), m30)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m0f),
                                    _mm512_and_si512(_mm512_srlv_epi16(qh, cnt_b), m30))};
                for (int k = 0; k < 2; k++) {
                    const int c = 2 * h + k;
                    const __m512i scale = _mm512_permutexvar_epi32(idx[c], sc);
                    for (int i = 0; i < mr; i++) {
                        const xk_t *x = xs[i] + s;
                        const __m512i p = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(x->corr + 16 * c)), u[k],
                                                              _mm512_loadu_si512((const void *)(x->q + 64 * c)));
                        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, scale));
                    }
                }
            }
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(dw * xs[i][s].d), acc[i]);
        }
        for (int i = 0; i < mr; i++) y[(size_t)i * y_stride + n] = sum16_512(acc[i]);
    }
}

VNNI512_TARGET static inline __attribute__((always_inline)) void q4k_rows_512(
    const uint8_t *w, size_t row_bytes, int n0, int n1, int nsb, const xk_t *const *xs, int mr, float *y,
    size_t y_stride) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    __m512i idx[4]; /* chunk c's lanes 0-7: scale 2c, lanes 8-15: scale 2c + 1 */
    for (int c = 0; c < 4; c++)
        idx[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        __m512 acc[TILE_X];
        __m256 accm[TILE_X];
        for (int i = 0; i < TILE_X; i++) {
            acc[i] = _mm512_setzero_ps();
            accm[i] = _mm256_setzero_ps();
        }
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = row + (size_t)s * 144;
            for (int o = 0; o < 144; o += 64) LM_PREFETCH(b + o);
            const float dw = f16_at(b), dmin = f16_at(b + 2);
            uint32_t sm[4];
            k4_scales(b + 4, sm);
            const __m128i smv = _mm_loadu_si128((const __m128i *)sm);
            const __m512i sc = _mm512_cvtepu8_epi32(smv);                    /* lanes 0-7 the scales */
            const __m256i mins = _mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8)); /* the 8 mins */
            __m512i isum[TILE_X];
            for (int i = 0; i < TILE_X; i++) isum[i] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m256i nib = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
                const __m512i u = _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1), m0f);
                const __m512i scale = _mm512_permutexvar_epi32(idx[c], sc);
                for (int i = 0; i < mr; i++) {
                    const xk_t *x = xs[i] + s;
                    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                                          _mm512_loadu_si512((const void *)(x->q + 64 * c)));
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(p, scale));
                }
            }
            for (int i = 0; i < mr; i++) {
                const xk_t *x = xs[i] + s;
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(dw * x->d), acc[i]);
                const __m256i mb = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)x->bsum32));
                accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mb), _mm256_set1_ps(dmin * x->d), accm[i]);
            }
        }
        for (int i = 0; i < mr; i++) y[(size_t)i * y_stride + n] = sum16_512(acc[i]) - sum8_avx2(accm[i]);
    }
}

/* every tile size a constant, as on AVX2 */
#define ROWS_512(FN)                                                    \
    do {                                                                \
        switch (mr) {                                                   \
        case 1: FN(w, rb, n0, n1, nsb, xs, 1, y, N); break;             \
        case 2: FN(w, rb, n0, n1, nsb, xs, 2, y, N); break;             \
        case 3: FN(w, rb, n0, n1, nsb, xs, 3, y, N); break;             \
        default: FN(w, rb, n0, n1, nsb, xs, TILE_X, y, N);              \
        }                                                               \
    } while (0)

VNNI512_TARGET static void tile_512(int wtype, const uint8_t *w, size_t rb, int n0, int n1, int nsb,
                                    const xk_t *const *xs, int mr, float *y, int N) {
    if (wtype == LM_Q6_K) ROWS_512(q6k_rows_512);
    else ROWS_512(q4k_rows_512);
}

/* Rows n0..n1 in runs of ROWS_RUN, each run against all M rows of x TILE_X at a time (as
 * rows_avx2), so that W comes from memory once however many rows x has. */
VNNI512_TARGET static void rows_512(int wtype, const uint8_t *w, size_t rb, int n0, int n1, int nsb,
                                    const xk_t *xk, int M, float *y, int N) {
    for (int r0 = n0; r0 < n1; r0 += ROWS_RUN) {
        const int r1 = n1 - r0 < ROWS_RUN ? n1 : r0 + ROWS_RUN;
        for (int m0 = 0; m0 < M; m0 += TILE_X) {
            const int mr = M - m0 < TILE_X ? M - m0 : TILE_X;
            const xk_t *xs[TILE_X];
            for (int i = 0; i < TILE_X; i++) xs[i] = xk + (size_t)(m0 + (i < mr ? i : 0)) * nsb;
            tile_512(wtype, w, rb, r0, r1, nsb, xs, mr, y + (size_t)m0 * N, N);
        }
    }
}
#endif

/* ---- 8 rows interleaved: LM_Q4_KR, LM_Q6_KR ----------------------------------------------
 * Q4_K and Q6_K matrices of a multiple of 8 rows kept as rows8.c keeps Q4_0 / Q5_0 / Q8_0: a
 * group of 8 rows is nsb group-blocks, each the 8 rows' super-blocks rearranged so that a
 * 256-bit vector holds 4 weights of each row. x's 4 values at a time are broadcast, one product
 * gives 8 rows' partial sums, and a super-block's sums are scaled, converted and added once for
 * 8 rows, where the lanes contract above adds 16 lanes a row.
 *
 * The definition every tier computes (kr_rows_scalar), per row of W and row of x: per
 * super-block, S = the sum over its sub-blocks of the sub-block's scale times its products
 * (Q6_K: of q - 32; exact in integers), then acc = fmaf((float)S, d_w * d_x, acc); Q4_K then
 * acc = fmaf((float)-Mn, dmin_w * d_x, acc), Mn = the sum of the 8 mins times x's sums per 32.
 * Super-block after super-block from 0: one float sum a row, whatever rows surround it.
 *
 * A group-block, row r's bytes at r (a row's share: Q4_KR 148 bytes, 4 more than the file's
 * 144, its scales unpacked; Q6_KR 210, as the file's):
 *   Q4_KR: d[8] f16 (0), dmin[8] f16 (16), scales (32: sub-block p's at 8p + r) and mins (96:
 *          likewise) as bytes, then the nibbles (160): part q (the file's qs[32q..32q + 31]) is
 *          8 chunks of 32 bytes, chunk k's byte 4r + t row r's qs[32q + 4k + t] as stored: its
 *          low nibble weight 64q + 4k + t, its high nibble weight 64q + 32 + 4k + t.
 *   Q6_KR: d[8] f16 (0), scales int8 (16: sub-block j's at 8j + r), ql (144: part c = the
 *          file's ql[32c..32c + 31], 8 chunks of 32 bytes as Q4_KR's), qh (1168: part h = the
 *          file's qh[32h..32h + 31] likewise). Piece P = 4h + m (weights 32P..32P + 31) takes
 *          ql part 2h + m % 2, the low nibbles for m < 2 and the high ones after, and qh bits
 *          2m, 2m + 1 of part h, as the file does. */
#define KR_ROWS 8

static inline int kr_bytes(int wtype) { return wtype == LM_Q4_KR ? 148 : wtype == LM_Q6_KR ? 210 : 0; }

int lm_kquant_rows8_type(int wtype) { return kr_bytes(wtype) != 0; }

/* Row r's 256 weights of a group-block as unsigned values (Q6_K's q, not q - 32), its scales
 * (Q4_KR: 8, one per 32; Q6_KR: 16, one per 16), mins (Q4_KR) and d, dmin. */
static void kr_unpack(int wtype, const uint8_t *gb, int r, uint8_t u[QKK], int32_t sc[16], int32_t mn[8], float *d,
                      float *dmin) {
    *d = f16_at(gb + 2 * r);
    if (wtype == LM_Q4_KR) {
        *dmin = f16_at(gb + 16 + 2 * r);
        for (int p = 0; p < 8; p++) {
            sc[p] = gb[32 + 8 * p + r];
            mn[p] = gb[96 + 8 * p + r];
        }
        for (int q = 0; q < 4; q++)
            for (int l = 0; l < 32; l++) {
                const uint8_t b = gb[160 + 256 * q + 32 * (l / 4) + 4 * r + l % 4];
                u[64 * q + l] = b & 15;
                u[64 * q + 32 + l] = b >> 4;
            }
        return;
    }
    *dmin = 0.0f;
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)gb[16 + 8 * j + r];
    for (int P = 0; P < 8; P++) {
        const int h = P / 4, m = P % 4;
        for (int l = 0; l < 32; l++) {
            const int at = 32 * (l / 4) + 4 * r + l % 4;
            const uint8_t L = gb[144 + 256 * (2 * h + m % 2) + at], H = gb[1168 + 256 * h + at];
            u[32 * P + l] = (uint8_t)(((m >= 2 ? L >> 4 : L) & 15) | ((H >> (2 * m)) & 3) << 4);
        }
    }
}

/* The portable loop, and the definition the vector loops are held to. */
static void kr_rows_scalar(int wtype, const uint8_t *w, int g0, int g1, int nsb, const xk_t *xk, int M, float *y,
                           int N) {
    const size_t gbb = (size_t)KR_ROWS * kr_bytes(wtype);
    uint8_t u[QKK];
    int32_t sc[16], mn[8];
    float d, dmin;
    for (int g = g0; g < g1; g++)
        for (int r = 0; r < KR_ROWS; r++) {
            const int n = KR_ROWS * g + r;
            for (int m = 0; m < M; m++) y[(size_t)m * N + n] = 0.0f;
            for (int s = 0; s < nsb; s++) {
                kr_unpack(wtype, w + ((size_t)g * nsb + s) * gbb, r, u, sc, mn, &d, &dmin);
                for (int m = 0; m < M; m++) {
                    const xk_t *x = xk + (size_t)m * nsb + s;
                    float *o = y + (size_t)m * N + n;
                    int32_t S = 0, Mn = 0;
                    if (wtype == LM_Q4_KR) {
                        for (int p = 0; p < 8; p++) {
                            int32_t dot = 0;
                            for (int l = 0; l < 32; l++) dot += (int32_t)u[32 * p + l] * x->q[32 * p + l];
                            S += sc[p] * dot;
                            Mn += mn[p] * x->bsum32[p];
                        }
                        *o = fmaf((float)S, d * x->d, *o);
                        *o = fmaf((float)-Mn, dmin * x->d, *o);
                        continue;
                    }
                    int32_t C = 0;
                    for (int j = 0; j < 16; j++) {
                        int32_t dot = 0;
                        for (int l = 0; l < 16; l++) dot += (int32_t)u[16 * j + l] * x->q[16 * j + l];
                        S += sc[j] * dot;
                        C += sc[j] * x->bs16[j];
                    }
                    *o = fmaf((float)(S - 32 * C), d * x->d, *o);
                }
            }
        }
}

#ifdef LM_X86
#define KR_X4(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(p)))
#define KR_X_CHUNK_BYTES (256 * 1024)
/* loops whose count the unpacking and the choice of sum depend on, unrolled, so each is a constant */
#define KR_UNROLL _Pragma("GCC unroll 8")

/* Q6_KR's piece m of a half (ql chunk L, qh chunk H) as unsigned bytes: the nibble, and qh's
 * bits 2m, 2m + 1 brought to bits 4-5. */
#define KR_Q6(TARGET, SUF)                                                                                  \
    TARGET static inline __attribute__((always_inline)) __m256i q6u_##SUF(__m256i l, __m256i h, int m) {    \
        const __m256i lo = _mm256_and_si256(m >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0f));       \
        const __m256i hb = m == 0 ? _mm256_slli_epi16(h, 4) : m == 1 ? _mm256_slli_epi16(h, 2)                  \
                         : m == 2 ? h : _mm256_srli_epi16(h, 2);                                                 \
        return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));                              \
    }

/* Group g's 8 rows against MC rows of x (a constant; xk: their super-blocks, row i's at
 * xk + i * nsb). Q4_KR: a piece's 8 chunks summed, then times the 8 rows' scales: VNNI by
 * vpdpbusd into 32 bits and a multiply; AVX2 by maddubs, added in 16 bits (u <= 15: 16 products
 * a lane stay within them), then one madd by the scales. Q6_KR (u <= 63): two chunks' maddubs
 * added in 16 bits, then madd by the scales and an add (AVX2) or vpdpwssd (VNNI), the chunks of
 * a half's 4 pieces unpacked from the same 6 loads; with 1 or 2 rows of x into 4 or 2 sums a row
 * (one chain of adds would wait on itself). q - 32's offset: 32 times the scales by x's sums per
 * 16, made by madd of pairs of sub-blocks. */
#define KR_LOOP(SUF, TARGET, VNNI, TX)                                                                     \
    KR_Q6(TARGET, SUF)                                                                                      \
    TARGET static inline __attribute__((always_inline)) void kr_group_##SUF(                                \
        int wtype, const uint8_t *gw, int nsb, const xk_t *xk, int mc, float *y, int N, int n) {            \
        const size_t gbb = (size_t)KR_ROWS * kr_bytes(wtype);                                              \
        const __m256i m0f = _mm256_set1_epi8(0x0f);                                                         \
        __m256 acc[8];                                                                                      \
        for (int i = 0; i < mc; i++) acc[i] = _mm256_setzero_ps();                                          \
        for (int s = 0; s < nsb; s++) {                                                                     \
            const uint8_t *gb = gw + (size_t)s * gbb;                                                       \
            for (size_t o = 0; o < gbb; o += 64) LM_PREFETCH(gb + o);                                       \
            __m256i isum[8], corr[8];                                                                       \
            for (int i = 0; i < mc; i++) isum[i] = corr[i] = _mm256_setzero_si256();                        \
            if (wtype == LM_Q4_KR) {                                                                        \
                KR_UNROLL for (int p = 0; p < 8; p++) {                                                     \
                    const uint8_t *v = gb + 160 + 256 * (p / 2);                                            \
                    const __m128i s8 = _mm_loadl_epi64((const __m128i *)(gb + 32 + 8 * p));                 \
                    __m256i d[8];                                                                           \
                    for (int i = 0; i < mc; i++) d[i] = _mm256_setzero_si256();                             \
                    for (int k = 0; k < 8; k++) {                                                           \
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 32 * k));              \
                        const __m256i u = _mm256_and_si256(p % 2 ? _mm256_srli_epi16(raw, 4) : raw, m0f);   \
                        for (int i = 0; i < mc; i++) {                                                      \
                            const __m256i x4 = KR_X4(xk[(size_t)i * nsb + s].q + 32 * p + 4 * k);           \
                            if (VNNI == 1) d[i] = _mm256_dpbusd_avx_epi32(d[i], u, x4);                     \
                            else if (VNNI == 2) d[i] = _mm256_dpbusd_epi32(d[i], u, x4);                    \
                            else d[i] = _mm256_add_epi16(d[i], _mm256_maddubs_epi16(u, x4));                \
                        }                                                                                   \
                    }                                                                                       \
                    if (VNNI) {                                                                             \
                        const __m256i sc = _mm256_cvtepu8_epi32(s8);                                        \
                        for (int i = 0; i < mc; i++) isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(d[i], sc)); \
                    } else {                                                                                \
                        const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));                 \
                        for (int i = 0; i < mc; i++) isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(d[i], sc)); \
                    }                                                                                       \
                }                                                                                           \
                for (int pp = 0; pp < 4; pp++) { /* the mins, by pairs of sub-blocks */                     \
                    const __m256i mp = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(                              \
                        _mm_loadl_epi64((const __m128i *)(gb + 96 + 16 * pp)),                             \
                        _mm_loadl_epi64((const __m128i *)(gb + 104 + 16 * pp))));                          \
                    for (int i = 0; i < mc; i++)                                                            \
                        corr[i] = _mm256_add_epi32(corr[i], _mm256_madd_epi16(mp, KR_X4(xk[(size_t)i * nsb + s].bs32h + 2 * pp))); \
                }                                                                                           \
            } else {                                                                                        \
                const int nch = mc == 1 ? 4 : mc == 2 ? 2 : 1;                                              \
                __m256i ch[8][4];                                                                           \
                for (int i = 0; i < mc; i++)                                                                \
                    for (int c = 0; c < nch; c++) ch[i][c] = _mm256_setzero_si256();                        \
                KR_UNROLL for (int h = 0; h < 2; h++)                                                       \
                    KR_UNROLL for (int m = 0; m < 4; m++) /* piece P = 4h + m: ql part 2h + m % 2, qh part h */      \
                        KR_UNROLL for (int half = 0; half < 2; half++) { /* sub-block 2P + half: chunks 4half.. */   \
                            const int P = 4 * h + m;                                                        \
                            const uint8_t *l = gb + 144 + 256 * (2 * h + m % 2) + 128 * half;               \
                            const uint8_t *hq = gb + 1168 + 256 * h + 128 * half;                           \
                            const __m128i s8 = _mm_loadl_epi64((const __m128i *)(gb + 16 + 8 * (2 * P + half))); \
                            const __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));             \
                            KR_UNROLL for (int kk = 0; kk < 2; kk++) { /* chunks 4half + 2kk, and the next */       \
                                const __m256i u0 = q6u_##SUF(_mm256_loadu_si256((const __m256i *)(l + 64 * kk)), \
                                                             _mm256_loadu_si256((const __m256i *)(hq + 64 * kk)), m); \
                                const __m256i u1 = q6u_##SUF(_mm256_loadu_si256((const __m256i *)(l + 64 * kk + 32)), \
                                                             _mm256_loadu_si256((const __m256i *)(hq + 64 * kk + 32)), m); \
                                for (int i = 0; i < mc; i++) {                                              \
                                    const int8_t *xq = xk[(size_t)i * nsb + s].q + 32 * P + 16 * half + 8 * kk; \
                                    const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(u0, KR_X4(xq)), \
                                                                         _mm256_maddubs_epi16(u1, KR_X4(xq + 4))); \
                                    __m256i *c = &ch[i][(2 * m + kk) % nch];                                \
                                    if (VNNI == 1) *c = _mm256_dpwssd_avx_epi32(*c, p16, sc);               \
                                    else if (VNNI == 2) *c = _mm256_dpwssd_epi32(*c, p16, sc);              \
                                    else *c = _mm256_add_epi32(*c, _mm256_madd_epi16(p16, sc));             \
                                }                                                                           \
                            }                                                                               \
                        }                                                                                   \
                for (int i = 0; i < mc; i++)                                                                \
                    for (int c = 0; c < nch; c++) isum[i] = _mm256_add_epi32(isum[i], ch[i][c]);            \
                for (int jj = 0; jj < 8; jj++) { /* 32 times the scales by x's sums per 16 */               \
                    const __m256i sp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(                              \
                        _mm_loadl_epi64((const __m128i *)(gb + 16 + 16 * jj)),                             \
                        _mm_loadl_epi64((const __m128i *)(gb + 24 + 16 * jj))));                           \
                    for (int i = 0; i < mc; i++)                                                            \
                        corr[i] = _mm256_add_epi32(corr[i], _mm256_madd_epi16(sp, KR_X4(xk[(size_t)i * nsb + s].bs16 + 2 * jj))); \
                }                                                                                           \
                for (int i = 0; i < mc; i++) isum[i] = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(corr[i], 5)); \
            }                                                                                               \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));                        \
            for (int i = 0; i < mc; i++) {                                                                  \
                const __m256 dx = _mm256_set1_ps(xk[(size_t)i * nsb + s].d);                                \
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, dx), acc[i]);        \
            }                                                                                               \
            if (wtype == LM_Q4_KR) {                                                                        \
                const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 16)));             \
                for (int i = 0; i < mc; i++) {                                                              \
                    const __m256 dx = _mm256_set1_ps(xk[(size_t)i * nsb + s].d);                            \
                    const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), corr[i]);                  \
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(neg), _mm256_mul_ps(dm, dx), acc[i]);       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < mc; i++) _mm256_storeu_ps(y + (size_t)i * N + n, acc[i]);                       \
    }                                                                                                       \
                                                                                                            \
    /* Groups g0..g1 against the M rows of x: x in chunks a core's cache holds while every group   \
     * of the part meets them, TX rows at a time. */                                                        \
    TARGET static void kr_groups_##SUF(int wtype, const uint8_t *w, int g0, int g1, int nsb, const xk_t *xk, \
                                       int M, float *y, int N) {                                            \
        const size_t gbb = (size_t)KR_ROWS * kr_bytes(wtype);                                              \
        int chunk = (int)(KR_X_CHUNK_BYTES / ((size_t)nsb * sizeof(xk_t))) / TX * TX;                      \
        if (chunk < TX) chunk = TX;                                                                         \
        for (int c0 = 0; c0 < M; c0 += chunk) {                                                             \
            const int c1 = M - c0 < chunk ? M : c0 + chunk;                                                 \
            for (int g = g0; g < g1; g++) {                                                                 \
                const uint8_t *gw = w + (size_t)g * nsb * gbb;                                              \
                for (int m0 = c0, mc; m0 < c1; m0 += mc) {                                                  \
                    const xk_t *xt = xk + (size_t)m0 * nsb;                                                 \
                    float *yt = y + (size_t)m0 * N;                                                         \
                    const int left = c1 - m0;                                                               \
                    mc = left >= TX ? TX : TX > 4 && left >= 4 ? 4 : left == 3 ? 3 : left >= 2 ? 2 : 1; \
                    KR_TILE(SUF, TX)                                                                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

#define KR_GROUP(SUF, MC) kr_group_##SUF(wtype, gw, nsb, xt, MC, yt, N, KR_ROWS * g)
/* a tile of mc rows of x, its size a constant so the sums stay in registers: TX, then what is
 * left as 4 (AVX-512), 3 (the 256-bit tiers), 2 and 1, so that few sizes are compiled (each
 * is a long unrolled loop) */
#define KR_TILE(SUF, TX)                                  \
    {                                                     \
        if (mc == TX) KR_GROUP(SUF, TX);                  \
        else if (TX > 4 && mc == 4) KR_GROUP(SUF, 4);     \
        else if (mc == 3) KR_GROUP(SUF, 3);               \
        else if (mc == 2) KR_GROUP(SUF, 2);               \
        else KR_GROUP(SUF, 1);                            \
    }

/* tiles of 4 rows of x on the 256-bit tiers (16 registers), 8 on AVX-512 (32) */
KR_LOOP(avx2, AVX2_TARGET, 0, 4)
KR_LOOP(vnni, VNNI_TARGET, 1, 4)
KR_LOOP(vnni512, VNNI512_TARGET, 2, 8)

/* each format a constant, so each gets a loop of its own */
#define KR_BY_FORMAT(FN)                                                          \
    do {                                                                          \
        if (wtype == LM_Q4_KR) FN(LM_Q4_KR, w, g0, g1, nsb, xk, M, y, N);         \
        else FN(LM_Q6_KR, w, g0, g1, nsb, xk, M, y, N);                           \
    } while (0)
#endif

/* Groups of 8 rows dealt out in order, each against all M rows of x. */
static void kr_part(int level, int wtype, const uint8_t *w, int N, int nsb, const xk_t *xk, int M, float *y,
                    int part, int parts) {
    const int groups = N / KR_ROWS, per = (groups + parts - 1) / parts;
    const int g0 = part * per, g1 = (part + 1) * per < groups ? (part + 1) * per : groups;
    if (g0 >= g1) return;
#ifdef LM_X86
    if (level == LM_ISA_AVX512VNNI) {
        KR_BY_FORMAT(kr_groups_vnni512);
        return;
    }
    if (level == LM_ISA_AVXVNNI) {
        KR_BY_FORMAT(kr_groups_vnni);
        return;
    }
    if (level == LM_ISA_AVX2) {
        KR_BY_FORMAT(kr_groups_avx2);
        return;
    }
#endif
    (void)level;
    kr_rows_scalar(wtype, w, g0, g1, nsb, xk, M, y, N);
}

/* N rows of K weights (N a multiple of 8) from the file's Q4_K / Q6_K super-blocks into
 * ``packed`` (LM_Q4_KR, LM_Q6_KR), or back with reverse: the file's bytes exactly (Q4_K's 12
 * bytes of 6-bit scales and mins hold nothing else). */
typedef struct {
    const uint8_t *w;
    uint8_t *out;
    int packed, nsb, groups, reverse;
} kr_repack_job_t;

static void kr_repack_part(void *p, int part, int parts) {
    const kr_repack_job_t *J = (const kr_repack_job_t *)p;
    const int packed = J->packed, nsb = J->nsb, reverse = J->reverse, four = packed == LM_Q4_KR;
    const int sb = four ? 144 : 210, gbb = KR_ROWS * kr_bytes(packed);
    const int g0 = (int)((int64_t)J->groups * part / parts), g1 = (int)((int64_t)J->groups * (part + 1) / parts);
    for (int g = g0; g < g1; g++)
        for (int s = 0; s < nsb; s++) {
            uint8_t *gb = (reverse ? (uint8_t *)J->w : J->out) + ((size_t)g * nsb + s) * gbb;
            for (int r = 0; r < KR_ROWS; r++) {
                uint8_t *blk = (reverse ? J->out : (uint8_t *)J->w) + ((size_t)(KR_ROWS * g + r) * nsb + s) * sb;
                /* (to, from, bytes): the file's block and the group-block, one way or the other */
#define KR_MOVE(at_blk, at_gb, bytes) \
    (reverse ? memcpy(blk + (at_blk), gb + (at_gb), bytes) : memcpy(gb + (at_gb), blk + (at_blk), bytes))
                if (four) {
                    KR_MOVE(0, 2 * r, 2);
                    KR_MOVE(2, 16 + 2 * r, 2);
                    for (int q = 0; q < 4; q++)
                        for (int k = 0; k < 8; k++) KR_MOVE(16 + 32 * q + 4 * k, 160 + 256 * q + 32 * k + 4 * r, 4);
                    uint8_t *sc = gb + 32 + r, *mn = gb + 96 + r; /* a row's bytes, 8 apart */
                    if (!reverse) {
                        uint32_t sm[4];
                        k4_scales(blk + 4, sm);
                        const uint8_t *s8 = (const uint8_t *)sm;
                        for (int p = 0; p < 8; p++) {
                            sc[8 * p] = s8[p];
                            mn[8 * p] = s8[8 + p];
                        }
                    } else {
                        for (int j = 0; j < 4; j++) {
                            blk[4 + j] = (uint8_t)(sc[8 * j] | (sc[8 * (j + 4)] >> 4) << 6);
                            blk[8 + j] = (uint8_t)(mn[8 * j] | (mn[8 * (j + 4)] >> 4) << 6);
                            blk[12 + j] = (uint8_t)((sc[8 * (j + 4)] & 15) | (mn[8 * (j + 4)] & 15) << 4);
                        }
                    }
                    continue;
                }
                KR_MOVE(208, 2 * r, 2);
                for (int j = 0; j < 16; j++) KR_MOVE(192 + j, 16 + 8 * j + r, 1);
                for (int c = 0; c < 4; c++)
                    for (int k = 0; k < 8; k++) KR_MOVE(32 * c + 4 * k, 144 + 256 * c + 32 * k + 4 * r, 4);
                for (int h = 0; h < 2; h++)
                    for (int k = 0; k < 8; k++) KR_MOVE(128 + 32 * h + 4 * k, 1168 + 256 * h + 32 * k + 4 * r, 4);
#undef KR_MOVE
            }
        }
}

int lm_kquant_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads) {
    if (!lm_kquant_rows8_type(packed) || N < 0 || N % KR_ROWS != 0 || K % QKK != 0) return LM_EINVAL;
    kr_repack_job_t J = {w, out, packed, K / QKK, N / KR_ROWS, reverse};
    const size_t bytes = (size_t)N * (K / QKK) * kr_bytes(packed);
    const int threads = bytes >= (1u << 20) ? n_threads : 1;
    lm_pool_run(kr_repack_part, &J, lm_pool_parts(N / KR_ROWS, threads), threads);
    return LM_OK;
}

typedef struct {
    int level, wtype;
    const uint8_t *w;
    size_t row_bytes;
    int N, nsb, M;
    const xk_t *xk;
    float *y;
} kmm_job_t;

/* Rows of W in runs of 8, dealt out in order; against all M rows of x, TILE_X at a time. */
static void kmm_part(void *p, int part, int parts) {
    const kmm_job_t *J = (const kmm_job_t *)p;
    if (lm_kquant_rows8_type(J->wtype)) {
        kr_part(J->level, J->wtype, J->w, J->N, J->nsb, J->xk, J->M, J->y, part, parts);
        return;
    }
    const int runs = (J->N + 7) / 8, per = (runs + parts - 1) / parts;
    const int n0 = part * per * 8, n1 = (part + 1) * per * 8 < J->N ? (part + 1) * per * 8 : J->N;
    if (n0 >= n1) return;
#ifdef LM_X86
    if (J->level == LM_ISA_AVX512VNNI && J->wtype != LM_Q5_K) {
        rows_512(J->wtype, J->w, J->row_bytes, n0, n1, J->nsb, J->xk, J->M, J->y, J->N);
        return;
    }
    if (J->level == LM_ISA_AVXVNNI) {
        rows_vnni(J->wtype, J->w, J->row_bytes, n0, n1, J->nsb, J->xk, J->M, J->y, J->N);
        return;
    }
    if (J->level >= LM_ISA_AVX2) { /* and AVX-512 for Q5_K */
        rows_avx2(J->wtype, J->w, J->row_bytes, n0, n1, J->nsb, J->xk, J->M, J->y, J->N);
        return;
    }
#endif
    rows_scalar(J->wtype, J->w, J->row_bytes, n0, n1, J->nsb, J->xk, J->M, J->y, J->N);
}

int lm_qmatmul_k(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
                 int level) {
    const int rows8 = lm_kquant_rows8_type(wtype), sb = rows8 ? kr_bytes(wtype) : kquant_bytes(wtype);
    if (sb == 0 || K % QKK != 0 || M < 0 || N < 0 || (rows8 && N % KR_ROWS != 0)) return LM_EINVAL;
    const int nsb = K / QKK;
    xk_t *xk = aligned_alloc(64, sizeof(xk_t) * ((size_t)M * nsb + 1));
    if (xk == NULL) return LM_ENOMEM;
    quantize_rows_k(x, M, K, nsb, xk, n_threads);
    kmm_job_t J = {level, wtype, w, (size_t)nsb * sb, N, nsb, M, xk, y};
    const int threads = (size_t)N * nsb < 512 ? 1 : n_threads; /* too small to share out */
    lm_pool_run(kmm_part, &J, lm_pool_parts((N + 7) / 8, threads), threads);
    free(xk);
    return LM_OK;
}
