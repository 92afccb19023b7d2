/* y = x W^T with W's Q4_0, Q5_0 or Q8_0 blocks interleaved 8 rows at a time (LM_Q4_0R,
 * LM_Q5_0R, LM_Q8_0R; lm_rows8_repack makes them from the file's blocks), so that a 256-bit
 * vector holds one lane per weight row: x's 4 values at a time are broadcast, one VNNI product
 * (or maddubs + madd) gives 8 rows' partial sums at once, and a block's sums are converted and
 * scaled once for 8 rows, where the file's layout pays a conversion and an fma per block, row
 * of W and row of x (one a pair on AVX-512). llama.cpp's repacked CPU matmuls take the same
 * road.
 *
 * The definition every tier computes (rows_scalar): per row of W and row of x, each block's 32
 * products summed exactly in integers, S; then acc = fmaf((float)S, d_w * d_x, acc) block after
 * block from 0. One float sum a row, in block order: the same bits on every tier, and for a row
 * of x whatever rows of x or W are computed beside it.
 *
 * A group of 8 rows is nb group-blocks, each 8 times the file's block bytes:
 *   16 bytes: the 8 rows' float16 scales, row r's at 2r;
 *   Q8_0R: 8 chunks of 32 bytes: chunk k, byte 4r + t is row r's weight 4k + t, as stored;
 *   Q4_0R: 4 parts of 32 bytes: part j, byte 4r + t holds row r's u = w + 8 at 4j + t in its
 *          low nibble and at 4(j + 4) + t in its high nibble;
 *   Q5_0R: 4 parts of 8 bytes of high bits then 32 of nibbles (as Q4_0R's, u = w + 16):
 *          lane i = 4r + t of chunk j has its high bit in bit i / 8 of byte i % 8, of chunk
 *          j + 4 in bit 4 + i / 8 (one broadcast and a shift of each 64-bit quarter bring every
 *          lane's bit to bit 4 of its byte, as LM_Q5_0X's).
 * The unsigned u against x's signed bytes start from -offset times x's block sum: the same
 * integers as the signed products. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "localllm_native.h"

#define QK 32
#define RR 8 /* rows interleaved */

static inline int r_block_bytes(int wtype) { /* a row's share of a group-block */
    return wtype == LM_Q4_0R ? 18 : wtype == LM_Q5_0R ? 22 : wtype == LM_Q8_0R ? 34 : 0;
}

static inline int r_offset(int wtype) { return wtype == LM_Q8_0R ? 128 : wtype == LM_Q4_0R ? 8 : 16; }

int lm_rows8_type(int wtype) { return r_block_bytes(wtype) != 0; }

/* Row r's 32 weights of a group-block, signed, and its scale. */
static float r_unpack(int wtype, const uint8_t *gb, int r, int8_t *w) {
    uint16_t d;
    memcpy(&d, gb + 2 * r, 2);
    const uint8_t *q = gb + 16;
    const int five = wtype == LM_Q5_0R, part_bytes = five ? 40 : 32, off = r_offset(wtype);
    for (int pos = 0; pos < QK; pos++) {
        const int k = pos / 4, lane = 4 * r + pos % 4;
        if (wtype == LM_Q8_0R) {
            w[pos] = (int8_t)q[32 * k + lane];
            continue;
        }
        const int j = k % 4, hi = k / 4;
        const uint8_t *part = q + (size_t)j * part_bytes, *nib = part + (five ? 8 : 0);
        int u = (nib[lane] >> (4 * hi)) & 15;
        if (five) u |= ((part[lane % 8] >> (lane / 8 + 4 * hi)) & 1) << 4;
        w[pos] = (int8_t)(u - off);
    }
    return lm_half_to_float(d);
}

/* The portable loop, and the definition the vector loops are held to. y is the accumulator. */
static void rows_scalar(int wtype, const uint8_t *w, int g0, int g1, int nb, const int8_t *xq, const float *xd,
                        int M, float *y, int N) {
    const size_t gbb = (size_t)RR * r_block_bytes(wtype);
    int8_t q[QK];
    for (int g = g0; g < g1; g++)
        for (int r = 0; r < RR; r++) {
            const int n = RR * g + r;
            for (int m = 0; m < M; m++) y[(size_t)m * N + n] = 0.0f;
            for (int b = 0; b < nb; b++) {
                const float dw = r_unpack(wtype, w + ((size_t)g * nb + b) * gbb, r, q);
                for (int m = 0; m < M; m++) {
                    const int8_t *x = xq + ((size_t)m * nb + b) * QK;
                    int32_t s = 0;
                    for (int t = 0; t < QK; t++) s += (int32_t)q[t] * x[t];
                    float *o = y + (size_t)m * N + n;
                    *o = fmaf((float)s, dw * xd[(size_t)m * nb + b], *o);
                }
            }
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define R_X86 1

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VNNI512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

/* Part j of a group-block (after its scales) as chunks j and j + 4: unsigned for Q4_0R / Q5_0R
 * (u = w + offset), the weights as stored for Q8_0R. */
#define R_PART(TARGET, SUF)                                                                            \
    TARGET static inline __attribute__((always_inline)) void part_##SUF(int wtype, const uint8_t *q, int j, \
                                                                        __m256i *a, __m256i *b) {       \
        if (wtype == LM_Q8_0R) {                                                                        \
            *a = _mm256_loadu_si256((const __m256i *)(q + 32 * j));                                     \
            *b = _mm256_loadu_si256((const __m256i *)(q + 32 * (j + 4)));                               \
            return;                                                                                     \
        }                                                                                               \
        const int five = wtype == LM_Q5_0R;                                                             \
        const uint8_t *part = q + (size_t)j * (five ? 40 : 32);                                         \
        const __m256i nib = _mm256_loadu_si256((const __m256i *)(part + (five ? 8 : 0)));                \
        const __m256i m = _mm256_set1_epi8(0x0f);                                                       \
        *a = _mm256_and_si256(nib, m);                                                                  \
        *b = _mm256_and_si256(_mm256_srli_epi16(nib, 4), m);                                            \
        if (five) {                                                                                     \
            int64_t bits;                                                                               \
            memcpy(&bits, part, 8);                                                                     \
            const __m256i hb = _mm256_set1_epi64x(bits), h = _mm256_set1_epi8(0x10);                    \
            *a = _mm256_or_si256(*a, _mm256_and_si256(_mm256_sllv_epi64(hb, _mm256_setr_epi64x(4, 3, 2, 1)), h)); \
            *b = _mm256_or_si256(*b, _mm256_and_si256(_mm256_srlv_epi64(hb, _mm256_setr_epi64x(0, 1, 2, 3)), h)); \
        }                                                                                               \
    }

R_PART(AVX2_TARGET, avx2)
R_PART(VNNI_TARGET, vnni)
R_PART(VNNI512_TARGET, vnni512)

/* 4 products a lane, added to s: VNNI's one instruction, or AVX2's maddubs (unsigned by signed
 * bytes) and madd. AVX2 takes Q8_0R's signed weights by the sign trick (|w| times x with w's
 * signs). X4: 4 bytes of x broadcast to every lane. */
#define X4(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(p)))
#define DOT_VNNI(s, u, x) _mm256_dpbusd_avx_epi32(s, u, x)
#define DOT_VNNI512(s, u, x) _mm256_dpbusd_epi32(s, u, x)

/* Group g's 8 rows against MC rows of x (a constant). xc: per row of x and block, -offset times
 * the block's sum of x (VNNI's start value; AVX2 adds it at the end, Q8_0R's signed products
 * need none there). Chunks j, j + 1, j + 4 and j + 5 at a time: AVX2 adds Q4_0R's and Q5_0R's
 * four maddubs in 16 bits (u <= 31: 8 products a lane stay within them) before one madd. (Unpacking
 * a group once for all the tiles of rows of x, into scratch, was tried: 7 % faster at 64 rows of
 * x, 11 % slower at 8.) */
#define R_LOOP(SUF, TARGET, VNNI, TX)                                                                   \
    TARGET static inline __attribute__((always_inline)) void chunks_##SUF(int wtype, const uint8_t *gb,  \
                                                                          int j, __m256i *a, __m256i *c) { \
        part_##SUF(wtype, gb + 16, j, a, c);                                                            \
        if (VNNI && wtype == LM_Q8_0R) { /* VNNI's unsigned weights: u = w + 128 */                     \
            *a = _mm256_xor_si256(*a, _mm256_set1_epi8((char)0x80));                                    \
            *c = _mm256_xor_si256(*c, _mm256_set1_epi8((char)0x80));                                    \
        }                                                                                               \
    }                                                                                                   \
                                                                                                        \
    TARGET static inline __attribute__((always_inline)) void group_##SUF(                              \
        int wtype, const uint8_t *gw, int nb, const int8_t *xq, const float *xd,                        \
        const int32_t *xc, int mc, float *y, int N, int n) {                                            \
        const size_t gbb = (size_t)RR * r_block_bytes(wtype);                                          \
        const __m256i ones = _mm256_set1_epi16(1);                                                      \
        __m256 acc[8];                                                                                  \
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();                                       \
        for (int b = 0; b < nb; b++) {                                                                  \
            const uint8_t *gb = gw + (size_t)b * gbb;                                                   \
            for (size_t o = 0; o < gbb; o += 64) LM_PREFETCH(gb + o);                                   \
            __m256i s[8];                                                                               \
            for (int i = 0; i < mc; i++)                                                                \
                s[i] = VNNI ? _mm256_set1_epi32(xc[(size_t)i * nb + b]) : _mm256_setzero_si256();      \
            for (int j = 0; j < 4; j += 2) { /* chunks j, j + 1, j + 4, j + 5 */                       \
                __m256i a0, c0, a1, c1;                                                                 \
                chunks_##SUF(wtype, gb, j, &a0, &c0);                                                   \
                chunks_##SUF(wtype, gb, j + 1, &a1, &c1);                                               \
                /* AVX2's Q8_0R: |w|, once for the tile's rows of x */                                  \
                const __m256i aa0 = _mm256_sign_epi8(a0, a0), ac0 = _mm256_sign_epi8(c0, c0);           \
                const __m256i aa1 = _mm256_sign_epi8(a1, a1), ac1 = _mm256_sign_epi8(c1, c1);           \
                for (int i = 0; i < mc; i++) {                                                          \
                    const int8_t *xb = xq + ((size_t)i * nb + b) * QK;                                  \
                    /* each 4 bytes broadcast straight from memory (a load, no shuffle) */              \
                    const __m256i xa0 = X4(xb + 4 * j), xa1 = X4(xb + 4 * j + 4);                       \
                    const __m256i xc0 = X4(xb + 4 * j + 16), xc1 = X4(xb + 4 * j + 20);                 \
                    if (VNNI == 1) {                                                                    \
                        s[i] = DOT_VNNI(DOT_VNNI(s[i], a0, xa0), c0, xc0);                              \
                        s[i] = DOT_VNNI(DOT_VNNI(s[i], a1, xa1), c1, xc1);                              \
                    } else if (VNNI == 2) {                                                             \
                        s[i] = DOT_VNNI512(DOT_VNNI512(s[i], a0, xa0), c0, xc0);                        \
                        s[i] = DOT_VNNI512(DOT_VNNI512(s[i], a1, xa1), c1, xc1);                        \
                    } else if (wtype == LM_Q8_0R) { /* |w| times x with w's signs */                    \
                        const __m256i p0 = _mm256_add_epi32(                                            \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(aa0, _mm256_sign_epi8(xa0, a0)), ones), \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ac0, _mm256_sign_epi8(xc0, c0)), ones)); \
                        const __m256i p1 = _mm256_add_epi32(                                            \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(aa1, _mm256_sign_epi8(xa1, a1)), ones), \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ac1, _mm256_sign_epi8(xc1, c1)), ones)); \
                        s[i] = _mm256_add_epi32(s[i], _mm256_add_epi32(p0, p1));                        \
                    } else { /* u <= 31: 8 products a 16-bit lane stay within 16 bits */                \
                        const __m256i p = _mm256_add_epi16(                                             \
                            _mm256_add_epi16(_mm256_maddubs_epi16(a0, xa0), _mm256_maddubs_epi16(c0, xc0)), \
                            _mm256_add_epi16(_mm256_maddubs_epi16(a1, xa1), _mm256_maddubs_epi16(c1, xc1))); \
                        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));                      \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));                    \
            for (int i = 0; i < mc; i++) {                                                              \
                __m256i t = s[i];                                                                       \
                if (!VNNI && wtype != LM_Q8_0R) t = _mm256_add_epi32(t, _mm256_set1_epi32(xc[(size_t)i * nb + b])); \
                const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(xd[(size_t)i * nb + b]));             \
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), d, acc[i]);                             \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < mc; i++) _mm256_storeu_ps(y + (size_t)i * N + n, acc[i]);                   \
    }                                                                                                   \
                                                                                                        \
    /* Groups g0..g1 against the M rows of x: x in chunks of at most R_X_CHUNK_BYTES, which a    \
     * core's cache holds while every group of the part meets them, TX rows at a time. */          \
    TARGET static void groups_##SUF(int wtype, const uint8_t *w, int g0, int g1, int nb, const int8_t *xq,  \
                                    const float *xd, const int32_t *xc, int M, float *y, int N) {        \
        const size_t gbb = (size_t)RR * r_block_bytes(wtype);                                          \
        int chunk = (int)(R_X_CHUNK_BYTES / ((size_t)nb * (QK + 8))) / TX * TX;                         \
        if (chunk < TX) chunk = TX;                                                                     \
        for (int c0 = 0; c0 < M; c0 += chunk) {                                                         \
            const int c1 = M - c0 < chunk ? M : c0 + chunk;                                             \
            for (int g = g0; g < g1; g++) {                                                             \
                const uint8_t *gw = w + (size_t)g * nb * gbb;                                           \
                for (int m0 = c0; m0 < c1; m0 += TX) {                                                  \
                    const size_t xo = (size_t)m0 * nb;                                                  \
                    float *yt = y + (size_t)m0 * N;                                                     \
                    const int mc = c1 - m0 < TX ? c1 - m0 : TX;                                         \
                    TILE(SUF, TX)                                                                       \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

#define GROUP(SUF, MC) group_##SUF(wtype, gw, nb, xq + xo * QK, xd + xo, xc + xo, MC, yt, N, RR * g)
/* a tile of mc <= TX rows of x, its size a constant: the sums stay in registers */
#define TILE(SUF, TX)                                  \
    {                                                  \
        if (mc == TX) GROUP(SUF, TX);                  \
        else if (mc == 1) GROUP(SUF, 1);               \
        else if (mc == 2) GROUP(SUF, 2);               \
        else if (mc == 3) GROUP(SUF, 3);               \
        else if (TX > 4 && mc == 4) GROUP(SUF, 4);     \
        else if (TX > 5 && mc == 5) GROUP(SUF, 5);     \
        else if (TX > 6 && mc == 6) GROUP(SUF, 6);     \
        else GROUP(SUF, 7);                            \
    }
#define R_X_CHUNK_BYTES (256 * 1024)

/* tiles of 4 rows of x on the 256-bit tiers (16 registers; 8 measured no faster), 8 on AVX-512 (32) */
R_LOOP(avx2, AVX2_TARGET, 0, 4)
R_LOOP(vnni, VNNI_TARGET, 1, 4)
R_LOOP(vnni512, VNNI512_TARGET, 2, 8)

/* each format a constant, so each gets a loop of its own with no test of it inside */
#define BY_FORMAT(FN)                                                                                   \
    switch (wtype) {                                                                                    \
    case LM_Q8_0R: FN(LM_Q8_0R, w, g0, g1, nb, xq, xd, xc, M, y, N); break;                             \
    case LM_Q5_0R: FN(LM_Q5_0R, w, g0, g1, nb, xq, xd, xc, M, y, N); break;                             \
    default: FN(LM_Q4_0R, w, g0, g1, nb, xq, xd, xc, M, y, N);                                          \
    }
#endif

typedef struct {
    int level, wtype, N, nb, M;
    const uint8_t *w;
    const int8_t *xq;
    const float *xd;
    const int32_t *xc;
    float *y;
} r_job_t;

static void r_part(void *p, int part, int parts) {
    const r_job_t *J = (const r_job_t *)p;
    const int groups = J->N / RR, per = (groups + parts - 1) / parts;
    const int g0 = part * per, g1 = (part + 1) * per < groups ? (part + 1) * per : groups;
    if (g0 >= g1) return;
    const int wtype = J->wtype, nb = J->nb, M = J->M, N = J->N;
    const uint8_t *w = J->w;
    const int8_t *xq = J->xq;
    const float *xd = J->xd;
    const int32_t *xc = J->xc;
    float *y = J->y;
#ifdef R_X86
    if (J->level == LM_ISA_AVX512VNNI) {
        BY_FORMAT(groups_vnni512)
        return;
    }
    if (J->level == LM_ISA_AVXVNNI) {
        BY_FORMAT(groups_vnni)
        return;
    }
    if (J->level == LM_ISA_AVX2) {
        BY_FORMAT(groups_avx2)
        return;
    }
#endif
    (void)xc;
    rows_scalar(wtype, w, g0, g1, nb, xq, xd, M, y, N);
}

int lm_rows8_matmul(int level, int wtype, const uint8_t *w, int N, int nb, const int8_t *xq, const float *xd,
                    int M, float *y, int n_threads) {
    if (!lm_rows8_type(wtype) || N % RR != 0 || nb < 0 || M < 0) return LM_EINVAL;
    int32_t *xc = malloc(sizeof(int32_t) * ((size_t)M * nb + 1));
    if (xc == NULL) return LM_ENOMEM;
    /* AVX2 multiplies Q8_0R's weights signed (no offset); every other loop unsigned */
    const int offset = wtype == LM_Q8_0R && level == LM_ISA_AVX2 ? 0 : r_offset(wtype);
    for (size_t i = 0; i < (size_t)M * nb; i++) {
        int32_t s = 0;
        for (int t = 0; t < QK; t++) s += xq[i * QK + t];
        xc[i] = -offset * s;
    }
    r_job_t J = {level, wtype, N, nb, M, w, xq, xd, xc, y};
    const int threads = (size_t)N * nb < 4096 ? 1 : n_threads; /* too small to share out */
    lm_pool_run(r_part, &J, lm_pool_parts(N / RR, threads), threads);
    free(xc);
    return LM_OK;
}

/* The high bits of a group-block's 4 parts (out: its bytes after the scales) from its 8 rows'
 * Q5_0 blocks (the first at blk, the next row's row_bytes on). Part j wants lane i = 4r + t's
 * bit of weight 4j + t in bit i / 8 of byte i % 8, of weight 4j + 16 + t in bit 4 + i / 8: the
 * transpose of the 8 x 8 bits whose byte L holds, for L < 4, rows 2L and 2L + 1's four bits
 * from 4j (low and high nibble), for L >= 4 those from 4j + 16 of rows 2(L - 4) and 2(L - 4) + 1. */
static void high_bits(const uint8_t *blk, size_t row_bytes, uint8_t *out) {
    uint32_t qh[RR];
    for (int r = 0; r < RR; r++) memcpy(&qh[r], blk + r * row_bytes + 2, 4);
    for (int j = 0; j < 4; j++) {
        uint64_t m = 0;
        for (int L = 0; L < 8; L++) {
            const int r = 2 * (L % 4), at = 4 * j + 16 * (L / 4);
            m |= (uint64_t)(((qh[r] >> at) & 15) | ((qh[r + 1] >> at) & 15) << 4) << (8 * L);
        }
        m = lm_transpose_bits(m);
        memcpy(out + (size_t)j * 40, &m, 8);
    }
}

/* N rows of K weights (N a multiple of 8) from the file's blocks (Q4_0, Q5_0, Q8_0) into
 * ``packed`` (LM_Q4_0R, LM_Q5_0R, LM_Q8_0R), or back with reverse. */
typedef struct {
    const uint8_t *w;
    uint8_t *out;
    int packed, N, nb, reverse;
} repack_job_t;

static void repack_part(void *p, int part, int parts) {
    const repack_job_t *J = (const repack_job_t *)p;
    const uint8_t *w = J->w;
    uint8_t *out = J->out;
    const int packed = J->packed, nb = J->nb, reverse = J->reverse, groups = J->N / RR;
    const int bb = r_block_bytes(packed), five = packed == LM_Q5_0R, off = r_offset(packed);
    const int qs_at = packed == LM_Q8_0R ? 2 : five ? 6 : 2;
    const int g0 = (int)((int64_t)groups * part / parts), g1 = (int)((int64_t)groups * (part + 1) / parts);
    for (int g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *gb = (reverse ? (uint8_t *)w : out) + ((size_t)g * nb + b) * RR * bb;
            const uint8_t *gbr = gb;
            if (!reverse) memset(gb, 0, (size_t)RR * bb);
            for (int r = 0; r < RR; r++) {
                uint8_t *blk = (reverse ? out : (uint8_t *)w) + ((size_t)(RR * g + r) * nb + b) * bb;
                if (reverse) {
                    int8_t q[QK];
                    memcpy(blk, gbr + 2 * r, 2);
                    r_unpack(packed, gbr, r, q);
                    if (packed == LM_Q8_0R) {
                        memcpy(blk + 2, q, QK);
                        continue;
                    }
                    uint32_t qh = 0;
                    for (int i = 0; i < 16; i++) {
                        const int u0 = q[i] + off, u1 = q[i + 16] + off;
                        blk[qs_at + i] = (uint8_t)((u0 & 15) | (u1 & 15) << 4);
                        qh |= (uint32_t)((u0 >> 4) & 1) << i | (uint32_t)((u1 >> 4) & 1) << (i + 16);
                    }
                    if (five) memcpy(blk + 2, &qh, 4);
                    continue;
                }
                memcpy(gb + 2 * r, blk, 2);
                uint8_t *q = gb + 16;
                if (packed == LM_Q8_0R) { /* chunk k: 4 bytes a row */
                    for (int k = 0; k < 8; k++) memcpy(q + 32 * k + 4 * r, blk + 2 + 4 * k, 4);
                    continue;
                }
                /* part j's byte 4r + t holds weights 4j + t (low nibble) and 4j + 16 + t (high):
                 * the file's byte 4j + t of the row as it is */
                for (int j = 0; j < 4; j++) memcpy(q + (size_t)j * (five ? 40 : 32) + (five ? 8 : 0) + 4 * r, blk + qs_at + 4 * j, 4);
            }
            if (!reverse && five) high_bits(w + ((size_t)RR * g * nb + b) * bb, (size_t)nb * bb, gb + 16);
        }
}

int lm_rows8_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads) {
    if (!lm_rows8_type(packed) || N % RR != 0 || N < 0 || K % QK != 0) return LM_EINVAL;
    repack_job_t J = {w, out, packed, N, K / QK, reverse};
    /* over the threads: a model's load repacks its every Q4_0 / Q5_0 / Q8_0 matrix */
    const size_t bytes = (size_t)N * (K / QK) * r_block_bytes(packed);
    const int threads = bytes >= (1u << 20) ? n_threads : 1;
    lm_pool_run(repack_part, &J, lm_pool_parts(N / RR, threads), threads);
    return LM_OK;
}
