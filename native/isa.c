/* Which vector instructions the kernels use: the CPU's best tier, or a lower one asked for with
 * lm_set_isa (the LOCALLLM_NATIVE_ISA switch of localllm/runners/torch/native.py), so that a
 * fast machine can run, test and time what a slower one runs, as torch's kernels follow
 * ATEN_CPU_CAPABILITY. Every kernel asks here; nothing else reads the CPU's features. */

#include "localllm_native.h"

static int detected = -1; /* the CPU's best tier (LM_ISA_*) */
static int tiers;          /* bit t: the CPU has tier t (AVX-512 VNNI without AVX-VNNI skips tier 2) */
static int cap = LM_ISA_AVX512VNNI; /* the tier asked for: the highest the CPU has at most this */
static int has_f16c, has_avx512; /* AVX-512 F/BW/VL/DQ with FMA: attention's wide copy, which needs no VNNI */

static void detect(void) {
    if (detected >= 0) return;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    has_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    const int avx2 = has_f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    has_avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const int avxvnni = avx2 && __builtin_cpu_supports("avxvnni");
    const int vnni512 = has_avx512 && __builtin_cpu_supports("avx512vnni");
    tiers = 1 << LM_ISA_SCALAR | avx2 << LM_ISA_AVX2 | avxvnni << LM_ISA_AVXVNNI | vnni512 << LM_ISA_AVX512VNNI;
#else
    tiers = 1 << LM_ISA_SCALAR;
#endif
    int best = LM_ISA_SCALAR;
    for (int t = LM_ISA_SCALAR; t <= LM_ISA_AVX512VNNI; t++)
        if (tiers >> t & 1) best = t;
    __atomic_store_n(&detected, best, __ATOMIC_RELEASE);
}

int lm_isa_detected(void) {
    detect();
    return detected;
}

int lm_isa_tiers(void) {
    detect();
    return tiers;
}

int lm_isa(void) {
    detect();
    int t = cap;
    while (!(tiers >> t & 1)) t--; /* tier 0 is always there */
    return t;
}

int lm_set_isa(int level) {
    detect();
    if (level < LM_ISA_SCALAR || level > LM_ISA_AVX512VNNI || !(tiers >> level & 1))
        return LM_EINVAL; /* never a tier the CPU lacks */
    cap = level;
    return LM_OK;
}

int lm_isa_f16c(void) {
    detect();
    return has_f16c && cap >= LM_ISA_AVX2;
}

int lm_isa_avx512(void) {
    detect();
    return has_avx512 && cap >= LM_ISA_AVX512VNNI; /* Skylake-X too: AVX-512 F without VNNI */
}
