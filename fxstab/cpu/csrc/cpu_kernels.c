/* Fused CPU kernels of fxstab: rounding + CESTAC digit statistics, and the GEMM surrogate.
 *
 * One pass over the samples of each element does what the plain-torch references do in about
 * thirty tensor passes (fxstab/numerics/rounding.py: round_with_bits and round_samples;
 * fxstab/numerics/digits.py: stats_vector; fxstab/numerics/surrogate.py: perturb_samples). The
 * random bits are the same Philox4x32-10 streams (fxstab/numerics/randbits.py), so rounded and
 * perturbed samples are bit-identical to the
 * references; the digit statistics agree to a few ulps (products by reciprocals, a vectorised
 * log10 series, reassociated block sums).
 *
 * Built at first use by fxstab/cpu/build.py (plain C, OpenMP, no Python or torch headers) and
 * called through ctypes with raw pointers. Samples are [n, numel] with sample k of element e at
 * x[k * xs + e]: xs = numel for stacked samples, xs = 0 for a plain tensor broadcast to every
 * sample.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the surrogate reads Philox words as little-endian bytes" /* fxstab falls back to torch */
#endif

#define MODE_NONE (-1)
#define MODE_RANDOM 0
#define MODE_STOCHASTIC 1
#define MODE_NEAREST 2
#define MODE_UP 3
#define MODE_DOWN 4
#define MODE_ZERO 5

#define MAX_SAMPLES 256

typedef struct {
    int64_t man_bits;      /* m: the format's stored significand bits */
    int64_t k;             /* emin + working bias (>= 1) */
    int64_t max_bits;      /* bit pattern of the format's largest finite value (working dtype) */
    int64_t min_sub_bits;  /* bit pattern of the format's smallest subnormal */
    int64_t finite_only;   /* fn format: overflow gives NaN, not inf */
    int64_t mode;          /* MODE_* */
    int64_t saturate;
    uint64_t seed;
    double t;              /* Student t quantile */
    double cap;            /* digit cap p*log10(2) */
    double zero_threshold;
    int64_t nthreads;
    uint64_t zmask;        /* address of a uint8 [numel] output: 1 at computational zeros (or 0) */
    double run_shift;      /* fxstab.numerics.digits.run_shift: the expected digits of a
                            * round-to-nearest run are run_shift - log10(s^2 / mean^2) / 2 */
    /* derived at entry (see derive_params), not set by the caller */
    double kd;             /* K + log10(n - 1) / 2: digits are kd - log10(var) / 2 */
    double vcap, vzero, vthr;  /* variances at which the digits reach the cap, 0, the threshold */
    /* the extras (extras_block): K = log10(sqrt(n) / t); the relative sample variances of the
     * cap's digits and of 0 digits; the histogram bin of rv_cap and the number of bins */
    double k0, rv_cap, rv_zero;
    int64_t b_cap, nbins;
    /* the expected run digits (stats[11]) as the digits: rkd - log10(v) / 2 with v the
     * variance of the relative deviations times n - 1 (as vcap, vzero), clamped to [rvcap,
     * rvzero] (the run's cap and 0 digits) */
    double rkd, rvcap, rvzero;
} params_t;

/* The statistics beyond the six digit reductions (fxstab.numerics.digits: EXTRA_STATS): the squared
 * Frobenius norms of the sample means and of the sample standard deviations (normwise digits),
 * the elements that underflowed, and the histogram of per-element digits (quantiles). Bins:
 * the top 16 bits of the fp64 relative sample variance (sign, exponent, 4 significand bits:
 * 16 bins per octave, at most 0.013 digits wide), between the cap's and 0 digits' variances;
 * the elements with 0 digits and with the cap's are counted apart. */
#define HBINS 2048
/* The quantiles sample at most about this many groups of 128 elements
 * (fxstab.numerics.digits): 512-1024 elements put a p10 within about 1% of its rank, at a
 * histogram increment per element. */
#define QGROUPS 8
typedef struct {
    double msq, vsq, under;
    double run; /* the expected run digits of the elements measured here, summed */
    int64_t sampled; /* elements in the histogram */
    /* the bins, then 0 digits, then the cap's; 4 counters a bin, used in turn by consecutive
     * elements (a run of elements in one bin does not wait on its own increments) */
    uint32_t hist[(HBINS + 2) * 4];
} ext_t;
#define HIST(e, b) ((e)->hist[(b) * 4] + (e)->hist[(b) * 4 + 1] + (e)->hist[(b) * 4 + 2] + \
                    (e)->hist[(b) * 4 + 3])

/* The grid the surrogate's perturbed values are rounded onto, stochastically and saturating
 * (fxstab.numerics.surrogate: grid_for, GRID_SALT): the format's constants in the working
 * dtype as rp_t holds them; on = 0: no rounding. */
typedef struct {
    int64_t on, man_bits, k, max_bits, min_sub_bits, finite_only;
} grid_t;

/* The surrogate of the GEMM that consumes a rounded output (fused into round_stats): eta,
 * seed and grid in, the number of insufficiently separated elements out. */
typedef struct {
    double eta;
    uint64_t seed;
    int64_t count;
    grid_t grid;
} fused_t;

/* Philox4x32-10 exactly as tl.philox / fxstab.numerics.randbits.philox. */
static inline void philox(uint64_t seed, uint32_t c[4]) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t pb = (uint64_t)0xCD9E8D57u * c[2];
        uint64_t pa = (uint64_t)0xD2511F53u * c[0];
        uint32_t n0 = (uint32_t)(pb >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(pa >> 32) ^ c[3] ^ k1;
        c[1] = (uint32_t)pb;
        c[3] = (uint32_t)pa;
        c[0] = n0;
        c[2] = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* fxstab.numerics.randbits.derive_seed of one salt (SplitMix64 finalisation of the seed mixed
 * with it). */
static uint64_t derive1(uint64_t z, uint64_t s) {
    z = z ^ (s + 0x9E3779B97F4A7C15ull + (z << 6) + (z >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* fxstab.numerics.surrogate.GRID_SALT */
#define GRID_SALT 0x67726964ull

/* Philox of `lanes` independent counters at once (c[word][lane]), the lane loop innermost so
 * it vectorises (32x32 -> 64-bit products are one instruction per 4 lanes on AVX2). */
#define PHILOX_LANES 128
#if defined(__AVX2__)
#include <immintrin.h>
/* lo and hi 32 bits of a * m per 32-bit lane: even lanes from one 32x32 -> 64 product, odd
 * lanes from another on the lanes shifted down, then two blends (no permutes) */
static inline void mulhilo8(__m256i a, __m256i m, __m256i *lo, __m256i *hi) {
    __m256i even = _mm256_mul_epu32(a, m);
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
#endif

static inline void philox_lanes(uint64_t seed, uint32_t c[4][PHILOX_LANES], int lanes) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int first = 0; /* lanes before `first` are done */
#if defined(__AVX2__)
    /* 8 lanes at a time, the state in registers through the 10 rounds */
    const __m256i ma = _mm256_set1_epi32((int)0xD2511F53u), mb = _mm256_set1_epi32((int)0xCD9E8D57u);
    for (; first + 8 <= lanes; first += 8) {
        __m256i c0 = _mm256_loadu_si256((const __m256i *)&c[0][first]);
        __m256i c1 = _mm256_loadu_si256((const __m256i *)&c[1][first]);
        __m256i c2 = _mm256_loadu_si256((const __m256i *)&c[2][first]);
        __m256i c3 = _mm256_loadu_si256((const __m256i *)&c[3][first]);
        uint32_t r0 = k0, r1 = k1;
        for (int r = 0; r < 10; r++) {
            __m256i lo_b, hi_b, lo_a, hi_a;
            mulhilo8(c2, mb, &lo_b, &hi_b);
            mulhilo8(c0, ma, &lo_a, &hi_a);
            __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), _mm256_set1_epi32((int)r0));
            __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), _mm256_set1_epi32((int)r1));
            c1 = lo_b;
            c3 = lo_a;
            c0 = n0;
            c2 = n2;
            r0 += 0x9E3779B9u;
            r1 += 0xBB67AE85u;
        }
        _mm256_storeu_si256((__m256i *)&c[0][first], c0);
        _mm256_storeu_si256((__m256i *)&c[1][first], c1);
        _mm256_storeu_si256((__m256i *)&c[2][first], c2);
        _mm256_storeu_si256((__m256i *)&c[3][first], c3);
    }
    if (first == lanes) return;
#endif
    for (int r = 0; r < 10; r++) {
        for (int l = first; l < lanes; l++) {
            uint64_t pb = (uint64_t)0xCD9E8D57u * c[2][l];
            uint64_t pa = (uint64_t)0xD2511F53u * c[0][l];
            uint32_t n0 = (uint32_t)(pb >> 32) ^ c[1][l] ^ k0;
            uint32_t n2 = (uint32_t)(pa >> 32) ^ c[3][l] ^ k1;
            c[1][l] = (uint32_t)pb;
            c[3][l] = (uint32_t)pa;
            c[0][l] = n0;
            c[2][l] = n2;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* Cross-sample scheme of fxstab.numerics.rounding.sample_draws: draw index and flip of each
 * sample. */
static int sample_draws(int64_t n, int *draws, int *flips) {
    int free_ = 0, start = (int)(n % 2);
    for (int i = 0; i < n; i++) {
        int j = i - start;
        if (i >= start && j % 2 == 1) {
            draws[i] = draws[i - 1];
            flips[i] = 1;
        } else {
            draws[i] = free_++;
            flips[i] = 0;
        }
    }
    return free_;
}

/* ---------------------------------------------------------------------------------------
 * Rounding of one value (round_with_bits), for fp32 (uint32 patterns) and fp64 (uint64).
 * `rnd` is the random bit (random mode) or the 32-bit word (stochastic mode). `mode` is a
 * compile-time constant at every call site (the callers are specialised per mode), so the
 * switch folds away and the element loops vectorise.
 */
typedef struct {
    int64_t m, k, max_bits, min_sub_bits, finite_only, saturate;
} rp_t;

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define NOINLINE static __attribute__((noinline))

/* Whether a value moves one unit away from zero, per mode: `par` holds the kept part's last
 * bit at position sh, `rem` what lies below it (low_mask = 2^sh - 1), `shift` the unclamped
 * shift (stochastic mode compares the word with the remainder's top 32 bits), `rnd` the random
 * bit (random mode) or 32-bit word (stochastic mode). Sets `go`. */
#define ROUND_GO(UT, IT, SH_MAX, go, mode, par, rem, low_mask, sh, shift, neg, rnd)            \
    switch (mode) {                                                                             \
    case MODE_NEAREST: go = (((par) >> (sh)) & 1) + (rem) > ((low_mask) >> 1) + 1; break;      \
    case MODE_UP: go = ((rem) != 0) & ((neg) ^ 1); break;                                       \
    case MODE_DOWN: go = ((rem) != 0) & (neg); break;                                           \
    case MODE_RANDOM: go = ((rem) != 0) & (int)(rnd); break; /* rnd is 0 or 1 */                \
    case MODE_STOCHASTIC: {                                                                     \
        /* word >> (32 - shift) < rem >> (shift - 32), both shifts clamped at 0 */              \
        IT a_ = 32 - (shift), b_ = (shift) - 32;                                                \
        a_ = a_ < 0 ? 0 : a_;                                                                   \
        b_ = b_ < 0 ? 0 : (b_ > (SH_MAX) ? (SH_MAX) : b_);                                      \
        go = (UT)(a_ >= 32 ? 0u : (rnd) >> a_) < ((rem) >> b_);                                 \
        break;                                                                                  \
    }                                                                                           \
    default: go = 0;                                                                            \
    }

#define DEFINE_ROUND(NAME, UT, IT, WM, SH_MAX)                                                       \
    ALWAYS_INLINE UT NAME(UT bits, const rp_t r, const int mode, uint32_t rnd) {                \
        const UT sign = (UT)1 << (8 * sizeof(UT) - 1);                                          \
        const UT inf_bits = (((UT)1 << (8 * sizeof(UT) - 1 - (WM))) - 1) << (WM);               \
        UT mag = bits & ~sign;                                                                  \
        const int neg = (int)(bits >> (8 * sizeof(UT) - 1)); /* arithmetic 0/1: vectorises */                                                           \
        const IT rm = (IT)r.m, rk = (IT)r.k;                                                   \
        IT e = (IT)(mag >> (WM));                                                     \
        const int may_be_tiny = rk - rm > 0;                                                        \
        UT significand = (may_be_tiny & (e > 1)) ? mag - ((UT)(e - 1) << (WM)) : mag;           \
        IT shift = rk - e;                                                                \
        shift = shift < 0 ? 0 : shift;                                                          \
        shift = shift > rk - 1 ? rk - 1 : shift;                                              \
        shift += (WM) - rm;                                                                    \
        int tiny = may_be_tiny & (shift > (WM));                                                 \
        IT sh = (may_be_tiny & (shift > (SH_MAX))) ? (SH_MAX) : shift;                      \
        UT unit = (UT)1 << sh;                                                                  \
        UT low_mask = unit - 1;                                                                 \
        UT rem = significand & low_mask;                                                        \
        int go = 0;                                                                             \
        ROUND_GO(UT, IT, SH_MAX, go, mode, significand, rem, low_mask, sh, shift, neg, rnd)      \
        UT res = tiny ? 0 : mag - rem;                                                          \
        unit = tiny ? (UT)r.min_sub_bits : unit;                                                \
        res = go ? res + unit : res;                                                            \
        int over = res > (UT)r.max_bits;                                                        \
        if (r.saturate) {                                                                       \
            res = over ? (UT)r.max_bits : res;                                                  \
        } else {                                                                                \
            UT big = r.finite_only ? (inf_bits | ((UT)1 << ((WM) - 1))) : inf_bits;             \
            int toward_zero;                                                                    \
            switch (mode) {                                                                     \
            case MODE_NEAREST: toward_zero = 0; break;                                          \
            case MODE_ZERO: toward_zero = 1; break;                                             \
            case MODE_UP: toward_zero = neg; break;                                             \
            case MODE_DOWN: toward_zero = !neg; break;                                          \
            default: toward_zero = res < mag;                                                   \
            }                                                                                   \
            res = over ? (toward_zero ? (UT)r.max_bits : big) : res;                            \
            res = mag == inf_bits ? big : res;                                                  \
        }                                                                                       \
        res = mag > inf_bits ? mag : res;                                                       \
        return res | (bits & sign);                                                             \
    }

DEFINE_ROUND(round_f32, uint32_t, int32_t, 23, 30)
DEFINE_ROUND(round_f64, uint64_t, int64_t, 52, 62)

/* The rounding of a value whose exponent lies in the format's normal range below its top
 * binade (or of a zero): no subnormal, overflow or NaN case, the unit is 2^(WM - m). The same
 * bits as the general ROUND for those values, in a third of the instructions. */
#define DEFINE_ROUND_NORMAL(NAME, UT, IT, WM, SH_MAX)                                           \
    ALWAYS_INLINE UT NAME(UT bits, const IT sh, const int mode, uint32_t rnd) {                 \
        const UT unit = (UT)1 << sh, low_mask = unit - 1, rem = bits & low_mask;               \
        if (mode == MODE_RANDOM) /* up: add low_mask and truncate; down: truncate */             \
            return (bits + (low_mask & ((UT)0 - (UT)rnd))) & ~low_mask;                       \
        const int neg = (int)(bits >> (8 * sizeof(UT) - 1));                                    \
        int go;                                                                                 \
        ROUND_GO(UT, IT, SH_MAX, go, mode, bits, rem, low_mask, sh, sh, neg, rnd)                \
        return (bits - rem) + (go ? unit : 0);                                                  \
    }

DEFINE_ROUND_NORMAL(round_normal_f32, uint32_t, int32_t, 23, 30)
DEFINE_ROUND_NORMAL(round_normal_f64, uint64_t, int64_t, 52, 62)

/* Rounds `cnt` consecutive values of one sample; `rb` holds their random bits or words. A row
 * of normal values (the common case) takes the short path; one value that needs the general
 * treatment sends the whole row through the general one. There, with `uf`, an element whose
 * value is finite, non-zero and below the format's smallest normal (rounding takes it to a
 * subnormal or to zero) gets its flag set; the short path has no such value. */
#define DEFINE_ROUND_ROW(NAME, FT, UT, IT, WM, ROUND, NORMAL)                                   \
    ALWAYS_INLINE int NAME(const FT *restrict x, FT *restrict o, int64_t cnt, const rp_t r,     \
                           const int mode, const uint32_t *restrict rb,                         \
                           uint8_t *restrict uf) {                                              \
        const UT sign = (UT)1 << (8 * sizeof(UT) - 1);                                          \
        /* exponents [k, top - 1]: normal in the format, no overflow when rounding up */         \
        const UT e_lo = (UT)r.k, span = (UT)(((UT)r.max_bits >> (WM)) - 1) - e_lo;              \
        int all_normal = r.k >= 1 && ((UT)r.max_bits >> (WM)) > (UT)r.k;                        \
        /* infinities stay infinities in every mode unless the format saturates or has none */ \
        const UT inf_bits = (UT)(~sign) & ~(((UT)1 << (WM)) - 1);                               \
        const UT inf_ok = (UT)(!r.saturate && !r.finite_only);                                  \
        UT infs = 0;                                                                            \
        if (all_normal) {                                                                       \
            /* every magnitude 0 or in [e_lo, e_lo + span] binades: the least of mag - 1       \
             * (0 wraps to the top) and the largest mag, unsigned */                            \
            UT lo = ~(UT)0, hi = 0;                                                             \
            _Pragma("omp simd reduction(min:lo) reduction(max:hi)")                             \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                UT b;                                                                           \
                memcpy(&b, &x[el], sizeof b);                                                   \
                UT mag = b & ~sign;                                                             \
                lo = mag - 1 < lo ? mag - 1 : lo;                                               \
                hi = mag > hi ? mag : hi;                                                       \
            }                                                                                   \
            const UT lo_ok = (e_lo << (WM)) - 1, hi_end = (e_lo + span + 1) << (WM);            \
            all_normal = lo >= lo_ok && hi < hi_end;                                            \
            if (!all_normal && inf_ok && lo >= lo_ok && hi == inf_bits) {                       \
                /* an infinity is the largest: the same test with infinities counted as 0 */   \
                UT hi2 = 0;                                                                     \
                _Pragma("omp simd reduction(max:hi2)")                                          \
                for (int64_t el = 0; el < cnt; el++) {                                          \
                    UT b;                                                                       \
                    memcpy(&b, &x[el], sizeof b);                                               \
                    UT mag = b & ~sign;                                                         \
                    mag = mag == inf_bits ? 0 : mag;                                            \
                    hi2 = mag > hi2 ? mag : hi2;                                                \
                }                                                                               \
                all_normal = infs = hi2 < hi_end;                                               \
            }                                                                                   \
        }                                                                                       \
        if (all_normal) {                                                                       \
            const IT sh = (IT)(WM) - (IT)r.m;                                                   \
            if (!infs) {                                                                        \
                _Pragma("omp simd")                                                             \
                for (int64_t el = 0; el < cnt; el++) {                                          \
                    UT b;                                                                       \
                    memcpy(&b, &x[el], sizeof b);                                               \
                    b = NORMAL(b, sh, mode, rb[el]);                                            \
                    memcpy(&o[el], &b, sizeof b);                                               \
                }                                                                               \
                return 1; /* every value in the format's normal range: finite results */       \
            }                                                                                   \
            /* a masked row (-inf where attention may not look): the infinities as they are */  \
            _Pragma("omp simd")                                                                 \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                UT b;                                                                           \
                memcpy(&b, &x[el], sizeof b);                                                   \
                UT rounded = NORMAL(b, sh, mode, rb[el]);                                       \
                b = (b & ~sign) == inf_bits ? b : rounded;                                      \
                memcpy(&o[el], &b, sizeof b);                                                   \
            }                                                                                   \
            return 0; /* infinite results: the statistics look for them */                     \
        }                                                                                       \
        if (uf && r.k >= 1) {                                                                   \
            const UT tiny = (UT)r.k << (WM); /* the format's smallest normal */               \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                UT b;                                                                           \
                memcpy(&b, &x[el], sizeof b);                                                   \
                UT mag = b & ~sign;                                                             \
                uf[el] |= (uint8_t)((mag != 0) & (mag < tiny));                                 \
            }                                                                                   \
        }                                                                                       \
        _Pragma("omp simd")                                                                     \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            UT b;                                                                               \
            memcpy(&b, &x[el], sizeof b);                                                       \
            b = ROUND(b, r, mode, rb[el]);                                                      \
            memcpy(&o[el], &b, sizeof b);                                                       \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_ROUND_ROW(round_row_f32, float, uint32_t, int32_t, 23, round_f32, round_normal_f32)
DEFINE_ROUND_ROW(round_row_f64, double, uint64_t, int64_t, 52, round_f64, round_normal_f64)

/* log10 of a positive normal float: 2 atanh((m-1)/(m+1)) series on m in [sqrt(1/2), sqrt(2))
 * (error ~1e-7, the float's own), plain arithmetic so the scalar digit loop vectorises. */
ALWAYS_INLINE float log10_posf(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    int e = (int)(b >> 23) - 127;
    uint32_t mb = (b & 0x007FFFFFu) | 0x3F800000u;
    float m;
    memcpy(&m, &mb, sizeof m);
    int big = m > 1.41421356f;
    m = big ? 0.5f * m : m;
    e += big;
    float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    float ln = 2.0f * s * (1.0f + s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9)))));
    return (ln + (float)e * 0.693147181f) * 0.434294482f;
}

#define BLK 128
/* round_stats rounds each sample's rows of a superblock of SB groups in one run (a 8 KB
 * stream per sample for the prefetchers), then measures them group by group from the cache:
 * up to SB_MAX_N samples (12-48 KB of rows); the Philox words of a superblock's groups share
 * one buffer of MAX_SAMPLES entries */
#define SB 16
#define SB_MAX_N 16
_Static_assert(SB * SB_MAX_N <= MAX_SAMPLES, "a superblock's Philox words fit the buffer");

/* ---------------------------------------------------------------------------------------
 * CESTAC digits (fxstab.numerics.digits._digits, in the working dtype) of `cnt` elements whose n
 * samples are rows[i][el]; accumulates the statistics and writes digits to `dig` if given.
 */
#define DEFINE_DIGITS_BLOCK(NAME, FT, DBL_MIN_, LOG10, IT, TINY_, SCALE_)                                   \
    ALWAYS_INLINE void NAME(const FT *const *rows, int64_t n, int64_t cnt, const params_t *p,  \
                            double K, FT *restrict dig, uint8_t *restrict zm, double *s_sum,    \
                            double *s_min, double *s_max, double *s_zero, double *s_nf) {       \
        FT mn[BLK], mx[BLK], mean[BLK], s1[BLK], s2[BLK];                                       \
        int bad[BLK];                                                                           \
        /* statistics, not samples: products by reciprocals and reassociated sums are fine */   \
        const FT fn = (FT)n, inv_n = (FT)1 / fn, cap = (FT)p->cap, thr = (FT)p->zero_threshold;\
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            FT v = rows[0][el];                                                                 \
            mn[el] = v; mx[el] = v; bad[el] = v != v; mean[el] = v * inv_n;                \
        }                                                                                       \
        for (int64_t i = 1; i < n; i++) {                                                       \
            const FT *restrict row = rows[i];                                                   \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                FT v = row[el];                                                                 \
                bad[el] |= v != v;                                                              \
                mn[el] = v < mn[el] ? v : mn[el];                                               \
                mx[el] = v > mx[el] ? v : mx[el];                                               \
                mean[el] += v * inv_n;                                                          \
            }                                                                                   \
        }                                                                                       \
        FT s1inv[BLK], sc[BLK];                                                                 \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            s1[el] = 0; s2[el] = 0;                                                             \
            FT am = mean[el] < 0 ? -mean[el] : mean[el];                                        \
            /* 1 / |mean| overflows for a subnormal mean: scale by a power of 2 (exact) */      \
            sc[el] = am < (FT)(TINY_) ? (FT)(SCALE_) : (FT)1;                                   \
            s1inv[el] = (FT)1 / (am * sc[el]);                                                  \
        }                                                                                       \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const FT *restrict row = rows[i];                                                   \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                FT r = (row[el] * sc[el] - mean[el] * sc[el]) * s1inv[el];                      \
                s1[el] += r;                                                                    \
                s2[el] += r * r;                                                                \
            }                                                                                   \
        }                                                                                       \
        /* the digits first, element by element (a loop without reductions or stores under a \
         * condition vectorises: twice the speed of one loop doing both in fp64), then their   \
         * sums; one block: FT sums of <= 128 values in [0, 16] lose nothing that matters */   \
        FT cb[BLK];                                                                             \
        uint8_t zb[BLK], fb[BLK];                                                               \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            int finite = !bad[el] & (mn[el] - mn[el] == 0) & (mx[el] - mx[el] == 0);            \
            int identical = !bad[el] & (mn[el] == mx[el]);                                      \
            FT var = s2[el] - s1[el] * s1[el] * inv_n;                                          \
            var = var < 0 ? 0 : var;                                                            \
            var = var / (FT)(n - 1);                                                            \
            /* var = 0 -> log = -inf -> cap; NaN or inf -> 0; tiny -> above the cap */          \
            int normal = (var >= (FT)DBL_MIN_) & (var - var == 0);                              \
            FT lv = LOG10(normal ? var : (FT)1);                                                \
            FT c = (FT)-0.5 * lv + (FT)K;                                                       \
            c = normal ? c : (((var >= 0) & (var < (FT)DBL_MIN_)) ? cap : (FT)0);               \
            c = c > cap ? cap : (c < 0 ? (FT)0 : c);                                            \
            c = mean[el] == 0 ? (FT)0 : c;                                                      \
            c = identical ? cap : c;                                                            \
            c = finite ? c : (FT)0;                                                             \
            int exact_zero = identical & (mx[el] == 0);                                         \
            zb[el] = (uint8_t)(finite & !exact_zero & (c < thr));                               \
            fb[el] = (uint8_t)!finite;                                                          \
            cb[el] = c;                                                                         \
        }                                                                                       \
        FT sum = 0, lo = (FT)p->cap, hi = 0;                                                    \
        IT zeros = 0, nf = 0;                                                                   \
        _Pragma("omp simd reduction(+:sum, zeros, nf) reduction(min:lo) reduction(max:hi)")     \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            FT c = cb[el];                                                                      \
            zeros += zb[el];                                                                    \
            nf += fb[el];                                                                       \
            sum += c;                                                                           \
            lo = c < lo ? c : lo;                                                               \
            hi = c > hi ? c : hi;                                                               \
        }                                                                                       \
        if (zm) memcpy(zm, zb, (size_t)cnt);                                                    \
        if (dig) memcpy(dig, cb, (size_t)cnt * sizeof(FT));                                     \
        *s_sum += (double)sum; *s_zero += (double)zeros; *s_nf += (double)nf;                   \
        *s_min = (double)lo < *s_min ? (double)lo : *s_min;                                     \
        *s_max = (double)hi > *s_max ? (double)hi : *s_max;                                     \
    }

DEFINE_DIGITS_BLOCK(digits_block_f32_scalar, float, 1.1754943508222875e-38, log10_posf, int32_t,
                    0x1p-100, 0x1p64)

/* ---------------------------------------------------------------------------------------
 * The extras of `cnt` elements (ext_t), exactly as fxstab.numerics.digits._moments2: the mean in the
 * samples' dtype as the digits take it (sum of x_i * (1 / n), no overflow near the dtype's
 * maximum), then in fp64 the deviations x_i - mean, s^2 = sum of their squares * (1 / (n - 1))
 * and mean^2. An element whose mean^2 and s^2 are finite adds them to the norms (a mean beyond
 * 1e154, in the fp64 format only, counts as non-finite here). With `bins` (the groups the
 * quantiles sample), its digits bin comes from the relative variance r = s^2 / mean^2 without a
 * division: bits(s^2) - bits(mean^2) + bits(1) is the bit pattern of r up to mean^2's
 * significand (a logarithm read off the bits, piecewise linear: within 0.09 octaves, 0.013
 * digits, of the exact one); the classes are comparisons (0 digits: a non-finite element, a
 * zero mean with spread, r >= rv_zero; the cap's: identical samples, r <= rv_cap). The element
 * loops are branch-free and vectorise. `uf` (or NULL) holds the underflow flags.
 */
/* log10 of a positive normal double in plain arithmetic (an element loop that calls it
 * vectorises): the series of vlog10_pos4, absolute error below 1e-14 */
ALWAYS_INLINE double log10_pos(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    int64_t e = (int64_t)(((uint64_t)b >> 52) & 0x7FF) - 1023;
    int64_t mb = (b & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll;
    double m;
    memcpy(&m, &mb, sizeof m);
    const int big = m > 1.4142135623730951;
    m = big ? 0.5 * m : m;
    e += big;
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    const double ln = 2.0 * s * (1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9
                      + s2 * (1.0 / 11 + s2 * (1.0 / 13 + s2 * (1.0 / 15))))))));
    /* (double)e without an int64 conversion (none in AVX2): added to the bits of 1.5 2^52 */
    const int64_t eb = e + 0x4338000000000000ll;
    double ed;
    memcpy(&ed, &eb, sizeof ed);
    ed -= 6755399441055744.0;
    return (ln + ed * 0.69314718055994530942) * 0.43429448190325182765;
}

/* One element's expected run digits (fxstab.numerics.digits._run_columns) from its moments as
 * the extras compute them (_moments2: ss = s^2, m2 = mean^2, finite, same): rkd - log10(v) / 2
 * with v = (n - 1) s^2 / mean^2 clamped to [rvcap, rvzero] (the digits clamped to [0, cap]);
 * identical samples the cap, a zero mean with spread or a non-finite element 0. */
ALWAYS_INLINE double run_digits1(double ss, double m2, int finite, int same, double n1,
                                 double rkd, double rvcap, double rvzero, double cap) {
    double v = ss / m2 * n1; /* m2 == 0: inf or NaN, replaced below */
    v = v < rvcap ? rvcap : (v > rvzero ? rvzero : v);
    v = v == v ? v : rvzero;
    double r = rkd - 0.5 * log10_pos(v);
    r = r < 0 ? 0 : (r > cap ? cap : r);
    r = v >= rvzero ? 0 : (v <= rvcap ? cap : r); /* at the clamps: exactly */
    r = m2 == 0 ? 0 : r;
    r = same ? cap : r;
    return finite ? r : 0;
}

/* One element's moments from its 3 samples (in the extras' element loops): declares ss, m2,
 * finite and same, and adds to msq and vsq when COUNT (the elements the digit loops did not
 * cover). */
#define EXTRAS_MOMENTS3(FT, A, B, C, COUNT)                                                     \
    const FT a = (A), b = (B), c = (C);                                                         \
    const FT m = (a * inv_n + b * inv_n) + c * inv_n;                                           \
    const double md = (double)m;                                                                \
    const double da = (double)a - md, db = (double)b - md, dc = (double)c - md;                 \
    const double ss = ((0.0 + da * da) + db * db + dc * dc) * inv_n1;                           \
    const double m2 = md * md;                                                                  \
    const int finite = (m2 - m2 == 0) & (ss - ss == 0);                                         \
    const int same = (b == a) & (c == a);                                                       \
    msq += finite && (COUNT) ? m2 : 0.0;                                                        \
    vsq += finite && (COUNT) ? ss : 0.0;

#define DEFINE_EXTRAS_BLOCK(NAME, FT)                                                           \
    ALWAYS_INLINE void NAME(const FT *const *rows, int64_t n, int64_t cnt, const params_t *p,  \
                            const uint8_t *restrict uf, int bins, int64_t start, ext_t *e) {    \
        /* nothing to measure here: a group whose digit loops measured every element, not   \
         * sampled for the quantiles, without underflow flags (most groups) */              \
        if (!bins && start >= cnt && !uf) return;                                               \
        const FT inv_n = (FT)1 / (FT)n;                                                         \
        const double inv_n1 = 1.0 / (double)(n - 1), n1 = (double)(n - 1);                     \
        const double rkd = p->rkd, rvcap = p->rvcap, rvzero = p->rvzero, cap = p->cap;          \
        double msq = 0, vsq = 0, run = 0;                                                       \
        double var[BLK], mean2[BLK];                                                            \
        int32_t fin_[BLK], same_[BLK];                                                          \
        /* straight-line code for N = 3: the element loop vectorises; without bins nothing is \
         * stored. The expected run digits of the elements from start (run_digits1) go with   \
         * the norms: in this loop, or in one over the stored moments */                      \
        if (n == 3 && !bins) {                                                                  \
            const FT *restrict r0 = rows[0], *restrict r1 = rows[1], *restrict r2 = rows[2];    \
            _Pragma("omp simd reduction(+:msq, vsq, run)")                                      \
            for (int64_t el = start; el < cnt; el++) {                                          \
                EXTRAS_MOMENTS3(FT, r0[el], r1[el], r2[el], 1)                                  \
                run += run_digits1(ss, m2, finite, same, n1, rkd, rvcap, rvzero, cap);          \
            }                                                                                   \
        } else if (n == 3) {                                                                    \
            const FT *restrict r0 = rows[0], *restrict r1 = rows[1], *restrict r2 = rows[2];    \
            _Pragma("omp simd reduction(+:msq, vsq)")                                           \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                EXTRAS_MOMENTS3(FT, r0[el], r1[el], r2[el], el >= start)                        \
                var[el] = ss; mean2[el] = m2; fin_[el] = finite; same_[el] = same;              \
            }                                                                                   \
        } else {                                                                                \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                const FT x0 = rows[0][el];                                                      \
                FT m = x0 * inv_n;                                                              \
                int same = 1;                                                                   \
                for (int64_t i = 1; i < n; i++) {                                               \
                    m += rows[i][el] * inv_n;                                                   \
                    same &= rows[i][el] == x0;                                                  \
                }                                                                               \
                const double md = (double)m;                                                    \
                double ss = 0;                                                                  \
                for (int64_t i = 0; i < n; i++) {                                               \
                    double d = (double)rows[i][el] - md;                                        \
                    ss += d * d;                                                                \
                }                                                                               \
                ss = ss * inv_n1;                                                               \
                const int finite = (md * md - md * md == 0) & (ss - ss == 0);                   \
                msq += finite && el >= start ? md * md : 0.0;                                   \
                vsq += finite && el >= start ? ss : 0.0;                                        \
                var[el] = ss; mean2[el] = md * md; fin_[el] = finite; same_[el] = same;        \
            }                                                                                   \
        }                                                                                       \
        if (n != 3 || bins) {                                                                   \
            _Pragma("omp simd reduction(+:run)")                                                \
            for (int64_t el = start; el < cnt; el++)                                            \
                run += run_digits1(var[el], mean2[el], fin_[el], same_[el], n1, rkd, rvcap,     \
                                   rvzero, cap);                                                \
        }                                                                                       \
        e->msq += msq;                                                                          \
        e->vsq += vsq;                                                                          \
        e->run += run;                                                                          \
        if (uf) {                                                                               \
            int64_t u = 0;                                                                      \
            for (int64_t el = 0; el < cnt; el++) u += uf[el];                                   \
            e->under += (double)u;                                                              \
        }                                                                                       \
        if (!bins) return;                                                                      \
        const double rv_cap = p->rv_cap, rv_zero = p->rv_zero;                                  \
        const int64_t b_cap = p->b_cap, nb = p->nbins, one = (int64_t)1023 << 52;              \
        int32_t idx[BLK];                                                                       \
        _Pragma("omp simd")                                                                     \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            const double ss = var[el], m2 = mean2[el];                                          \
            const int finite = fin_[el], same = same_[el];                                      \
            int64_t bs, bm;                                                                     \
            memcpy(&bs, &ss, sizeof bs);                                                        \
            memcpy(&bm, &m2, sizeof bm);                                                        \
            /* unsigned shifts vectorise on AVX2 (no 64-bit arithmetic shift): a pattern below \
             * 0 is a relative variance below 2^-1023, far under the cap's */                 \
            const int64_t dv = bs - bm + one;                                                   \
            int64_t b = (int64_t)((uint64_t)(dv > 0 ? dv : 0) >> 48) - b_cap;                   \
            b = b < 0 ? 0 : (b >= nb ? nb - 1 : b);                                             \
            const int zero_cls = !finite | (!same & ((m2 == 0) | !(ss < rv_zero * m2)));       \
            const int cap_cls = !zero_cls & (same | (ss <= rv_cap * m2));                       \
            idx[el] = (int32_t)(zero_cls ? nb : (cap_cls ? nb + 1 : b));                         \
        }                                                                                       \
        for (int64_t el = 0; el < cnt; el++) e->hist[idx[el] * 4 + (el & 3)]++;                 \
        e->sampled += cnt;                                                                      \
    }

DEFINE_EXTRAS_BLOCK(extras_block_f32_n, float)
DEFINE_EXTRAS_BLOCK(extras_block_f64_n, double)

/* N = 3 as a compile-time constant (the sample loops unroll, the element loop vectorises), one
 * copy for the seven mode bodies, as digits_block_f32 */
static __attribute__((noinline)) void extras_block_f32(const float *const *rows, int64_t n,
                                                       int64_t cnt, const params_t *p,
                                                       const uint8_t *uf, int bins,
                                                       int64_t start, ext_t *e) {
    if (n == 3) extras_block_f32_n(rows, 3, cnt, p, uf, bins, start, e);
    else extras_block_f32_n(rows, n, cnt, p, uf, bins, start, e);
}

static __attribute__((noinline)) void extras_block_f64(const double *const *rows, int64_t n,
                                                       int64_t cnt, const params_t *p,
                                                       const uint8_t *uf, int bins,
                                                       int64_t start, ext_t *e) {
    if (n == 3) extras_block_f64_n(rows, 3, cnt, p, uf, bins, start, e);
    else extras_block_f64_n(rows, n, cnt, p, uf, bins, start, e);
}

/* The digits of histogram bin b: those of the relative variance at the bin's middle. */
static double bin_digits(const params_t *p, int64_t b) {
    uint64_t bits = ((uint64_t)(b + p->b_cap) << 48) | ((uint64_t)1 << 47);
    double rv;
    memcpy(&rv, &bits, sizeof rv);
    double d = p->k0 - 0.5 * log10(rv);
    return d < 0 ? 0 : (d > p->cap ? p->cap : d);
}

/* The q-quantile of the sampled digits ("lower": the element of rank floor(q (count - 1)) in
 * ascending order) from the merged histogram. */
static double ext_quantile(const ext_t *e, const params_t *p, double q) {
    const int64_t numel = e->sampled;
    if (numel <= 0) return p->cap;
    int64_t r = (int64_t)floor(q * (double)(numel - 1)), cum = HIST(e, p->nbins);
    if (r < cum) return 0.0;
    for (int64_t b = p->nbins - 1; b >= 0; b--) {
        cum += HIST(e, b);
        if (r < cum) return bin_digits(p, b);
    }
    return p->cap;
}

/* ---------------------------------------------------------------------------------------
 * The fp32 digits in explicit 8-lane vectors (GCC/Clang vector extensions: AVX2 on x86,
 * pairs of NEON registers on ARM). The same arithmetic as digits_block_f32_scalar, which the
 * compiler's own vectorisation of left at a few times slower (gathers, a long dependency
 * chain per lane): one lane per element, the n samples in the inner loop, a log10 polynomial
 * in Estrin's form. The tail of a group (cnt % 8 elements) goes to the scalar block.
 */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

ALWAYS_INLINE vf8 vload8(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void vstore8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vf8 vsplat8(float x) { return (vf8){x, x, x, x, x, x, x, x}; }
/* m ? a : b per lane, m all-ones or zero */
ALWAYS_INLINE vf8 vsel8(vi8 m, vf8 a, vf8 b) { return (vf8)(((vi8)a & m) | ((vi8)b & ~m)); }

/* The same for 4 doubles (the fp64 blocks). */
typedef double vd4 __attribute__((vector_size(32)));
typedef int64_t vl4 __attribute__((vector_size(32)));

ALWAYS_INLINE vd4 vload4(const double *p) { vd4 v; memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void vstore4(double *p, vd4 v) { memcpy(p, &v, sizeof v); }
ALWAYS_INLINE vd4 vsplat4(double x) { return (vd4){x, x, x, x}; }
ALWAYS_INLINE vd4 vsel4(vl4 m, vd4 a, vd4 b) { return (vd4)(((vl4)a & m) | ((vl4)b & ~m)); }

/* max(a, b), min(a, b) of lanes without NaN */
#if defined(__AVX__)
#include <immintrin.h>
ALWAYS_INLINE vf8 vmax8(vf8 a, vf8 b) { return (vf8)_mm256_max_ps((__m256)a, (__m256)b); }
ALWAYS_INLINE vf8 vmin8(vf8 a, vf8 b) { return (vf8)_mm256_min_ps((__m256)a, (__m256)b); }
#else
ALWAYS_INLINE vf8 vmax8(vf8 a, vf8 b) { return vsel8(a > b, a, b); }
ALWAYS_INLINE vf8 vmin8(vf8 a, vf8 b) { return vsel8(a < b, a, b); }
#endif

/* Whether any lane of a mask is set. */
ALWAYS_INLINE int any8(vi8 m) {
#if defined(__AVX__)
    return _mm256_movemask_ps((__m256)m) != 0;
#else
    int r = 0;
    for (int l = 0; l < 8; l++) r |= m[l] != 0;
    return r;
#endif
}

/* log10 of positive normal lanes: log10(1 + x) = x P(x) on m = 1 + x in [sqrt(1/2), sqrt(2)),
 * P of degree 5 fitted (least squares at Chebyshev nodes) for an error below 7.5e-7 in the
 * log, 3.7e-7 in the digits; Estrin's form keeps the dependency chain short. */
ALWAYS_INLINE vf8 vlog10_8(vf8 v) {
    vi8 b = (vi8)v;
    vi8 e = (b >> 23) - 127;
    vf8 m = (vf8)((b & 0x007FFFFF) | 0x3F800000);
    vi8 big = m > vsplat8(1.41421356f);
    m = vsel8(big, m * 0.5f, m);
    e -= big; /* big is -1 where true */
    vf8 x = m - 1.0f, z = x * x, z2 = z * z;
    vf8 p01 = x * -0.2170795202255249f + 0.4343007206916809f;
    vf8 p23 = x * -0.1106899306178093f + 0.1442910134792328f;
    vf8 p45 = x * -0.06180094555020332f + 0.09695739299058914f;
    vf8 q = (p01 + z * p23) + z2 * p45;
    return q * x + __builtin_convertvector(e, vf8) * 0.301029996f;
}

/* Whether any lane of a 4-lane mask is set. */
ALWAYS_INLINE int any4(vl4 m) {
#if defined(__AVX__)
    return _mm256_movemask_pd((__m256d)m) != 0;
#else
    return (m[0] | m[1] | m[2] | m[3]) != 0;
#endif
}

/* The sum over sample pairs of ((x_i - x_j) sc / |mean|)^2 (inv = 1 / (|mean| sc)), sc
 * applied only when `scaled`: pair_squares8 for 8 floats, pair_squares4 for 4 doubles. */
#define DEFINE_PAIR_SQUARES(NAME, FT, VF, LOAD, SPLAT)                                          \
    ALWAYS_INLINE VF NAME(const FT *const *rows, int64_t n, int64_t el, VF sc, VF inv,          \
                          const int scaled) {                                                   \
        VF s = SPLAT(0);                                                                        \
        for (int64_t i = 0; i < n; i++)                                                         \
            for (int64_t j = i + 1; j < n; j++) {                                               \
                VF d = LOAD(rows[i] + el) - LOAD(rows[j] + el);                                 \
                VF r = (scaled ? d * sc : d) * inv;                                             \
                s += r * r;                                                                     \
            }                                                                                   \
        return s;                                                                               \
    }

DEFINE_PAIR_SQUARES(pair_squares8, float, vf8, vload8, vsplat8)
DEFINE_PAIR_SQUARES(pair_squares4, double, vd4, vload4, vsplat4)

/* The moments of one vector of elements (moments8: 8 floats; moments4: 4 doubles): their
 * mean, corrected variance of the relative deviations (times n - 1; for n <= 3 the sum over
 * sample pairs, no cancellation), finite, identical and exact-zero masks. A mean below TINY
 * is scaled by SCALE (a power of 2: exact) before 1 / |mean|, which would overflow. */
#define DEFINE_MOMENTS(NAME, FT, VF, VI, LOAD, SPLAT, SEL, ANY, PAIRS, ABSMASK, TINY, SCALE)     \
    ALWAYS_INLINE void NAME(const FT *const *rows, int64_t n, int64_t el, FT inv_n, VF *mean_, \
                            VF *var_, VI *finite_, VI *identical_, VI *exact_zero_,             \
                            const int finite_known) {                                           \
        const VF zero = SPLAT(0);                                                               \
        const VI absmask = (VI){0} + (ABSMASK);                                                 \
        const VF v0 = LOAD(rows[0] + el);                                                       \
        VF mean = v0 * inv_n, nan_if_not_finite = v0 - v0; /* x - x: 0, or NaN for inf/NaN */   \
        VI same = (VI){0} - 1;                                                                  \
        for (int64_t i = 1; i < n; i++) {                                                       \
            VF v = LOAD(rows[i] + el);                                                          \
            same &= v == v0;                                                                    \
            if (!finite_known) nan_if_not_finite += v - v;                                      \
            mean += v * inv_n;                                                                  \
        }                                                                                       \
        VF am = (VF)((VI)mean & absmask);                                                       \
        VI small = am < SPLAT(TINY);                                                            \
        VF sc = SEL(small, SPLAT(SCALE), SPLAT(1));                                             \
        if (n <= 3) {                                                                           \
            /* sum over pairs (r_i - r_j)^2 = n sum (r_i - mean r)^2: no cancellation, no      \
             * clamp; no lane scaled (sc = 1, the usual case): the same bits without it */     \
            VF s = ANY(small) ? PAIRS(rows, n, el, sc, (FT)1 / (am * sc), 1)                    \
                              : PAIRS(rows, n, el, sc, (FT)1 / am, 0);                          \
            *var_ = s * inv_n;                                                                  \
        } else {                                                                                \
            VF inv = (FT)1 / (am * sc), ms = mean * sc;                                         \
            VF s1 = zero, s2 = zero;                                                            \
            for (int64_t i = 0; i < n; i++) {                                                   \
                VF r = (LOAD(rows[i] + el) * sc - ms) * inv;                                    \
                s1 += r;                                                                        \
                s2 += r * r;                                                                    \
            }                                                                                   \
            VF var = s2 - s1 * s1 * inv_n;                                                      \
            *var_ = SEL(var < zero, zero, var);                                                 \
        }                                                                                       \
        *mean_ = mean;                                                                          \
        /* finite: every sample (a NaN or inf one makes the sum of x - x NaN); identical: all  \
         * equal to the first (for finite samples; the masks are only read with finite) */     \
        *finite_ = finite_known ? (VI){0} - 1 : nan_if_not_finite == zero;                      \
        *identical_ = same;                                                                     \
        *exact_zero_ = same & (v0 == zero);                                                     \
    }

DEFINE_MOMENTS(moments8, float, vf8, vi8, vload8, vsplat8, vsel8, any8, pair_squares8,
               0x7FFFFFFF, 0x1p-100f, 0x1p64f)
DEFINE_MOMENTS(moments4, double, vd4, vl4, vload4, vsplat4, vsel4, any4, pair_squares4,
               0x7FFFFFFFFFFFFFFFll, 0x1p-1000, 0x1p128)

/* The expected digits of a round-to-nearest run (stats[11], fxstab.numerics.digits
 * _run_columns) of 8 fp32 elements, as the digits' sums take them: the variance var of the
 * relative deviations (times n - 1, from moments8) clamped to [rvcap, rvzero], rvcap for
 * identical samples, rvzero for a zero mean with spread or a non-finite element (a sample, or
 * the mean: the reference's mean^2 then is not finite); their product (run_fold8) gives the
 * sum of rkd - log10(v) / 2 as the digits' gives theirs (acc8_finish). A second clamp of the same variance: the run's cap
 * and 0 digits lie at other variances than the digits' (a shift of its own).
 *
 * The reference takes s^2 about the mean rounded to the samples' dtype, in fp64 (_moments2):
 * s^2 + n / (n - 1) (rounding error of the mean)^2, the same variance as var to 1e-5
 * relative wherever var / (n - 1) >= 2^-25 (the error is at most ~2^-22 of the mean: 3 2^-44
 * against 2^-25) and the mean is not tiny (>= 2^-100: its rounding error can be most of it
 * near the subnormals). The lanes below either (samples a few ulps of their dtype apart, a
 * format as wide as the samples; or NaN) take the reference's own arithmetic (run_exact8):
 * none of a format of 11 significand bits or fewer for N <= 8 (their distinct samples lie
 * 2^-12 apart or more), at a branch per vector (the arithmetic out of line). */
#define RUN_EXACT_F32 0x1p-25f
#define RUN_EXACT_F64 0x1p-62
#define RUN_TINY_F32 0x1p-100f
#define RUN_TINY_F64 0x1p-450
#define RUN_HUGE_F64 0x1p500

/* The run's clamped variances of the `exact` lanes of 8 fp32 elements (their samples at el,
 * their means) from the reference's own moments (_moments2, EXTRAS_MOMENTS3: s^2 about the
 * mean and mean^2 in fp64), with the conventions of run_digits1 as variances; `v` in the
 * other lanes. Out of line: the element loops only branch here. */
typedef float vf4 __attribute__((vector_size(16)));
NOINLINE vf8 run_exact8(const float *const *rows, int64_t n, int64_t el, vf8 mean, vi8 exact,
                        vf8 v, double rvcap_d, double rvzero_d) {
    const double inv_n1 = 1.0 / (double)(n - 1), n1 = (double)(n - 1);
    const vd4 rvcap = vsplat4(rvcap_d), rvzero = vsplat4(rvzero_d), zero = vsplat4(0.0);
    float out[8], mf[8];
    vstore8(mf, mean);
    for (int h = 0; h < 8; h += 4) {
        vf4 f;
        memcpy(&f, mf + h, sizeof f);
        const vd4 md = __builtin_convertvector(f, vd4);
        memcpy(&f, rows[0] + el + h, sizeof f);
        const vd4 x0 = __builtin_convertvector(f, vd4);
        vd4 ss = zero;
        vl4 same = (vl4){0} - 1;
        for (int64_t i = 0; i < n; i++) {
            memcpy(&f, rows[i] + el + h, sizeof f);
            const vd4 x = __builtin_convertvector(f, vd4), d = x - md;
            ss += d * d;
            same &= x == x0;
        }
        ss = ss * inv_n1;
        const vd4 m2 = md * md;
        const vl4 fin = ((m2 - m2) == zero) & ((ss - ss) == zero);
        vd4 q = ss / m2 * n1;
        q = vsel4(q < rvcap, rvcap, vsel4(q > rvzero, rvzero, q));
        q = vsel4((q == q) & (m2 != zero), q, rvzero);
        q = vsel4(same, rvcap, q);
        q = vsel4(fin, q, rvzero);
        f = __builtin_convertvector(q, vf4);
        memcpy(out + h, &f, sizeof f);
    }
    return vsel8(exact, vload8(out), v);
}

/* The run's clamped variances of 8 fp32 elements from their moments (moments8), the digits'
 * `measured` lanes (finite, not identical, mean != 0) and `w`, the variances with the classes
 * of the digits' clamp (var where measured, 0 for identical finite samples, inf otherwise);
 * unless the samples are known finite, a mean that overflowed (finite samples) counts as
 * non-finite here, as in the reference. */
ALWAYS_INLINE vf8 run_var8(const float *const *rows, int64_t n, int64_t el, vf8 mean, vf8 var,
                           vi8 measured, vf8 w, vf8 rvcap, vf8 rvzero, const int finite_known) {
    if (!finite_known) {
        const vi8 mfin = (mean - mean) == vsplat8(0.0f);
        measured &= mfin;
        w = vsel8(mfin, w, vsplat8(INFINITY));
    }
    const vf8 v = vmin8(vmax8(w, rvcap), rvzero);
    const vf8 am = (vf8)((vi8)mean & 0x7FFFFFFF);
    const vi8 exact = measured & ~((var >= vsplat8(RUN_EXACT_F32 * (float)(n - 1))) &
                                   (am >= vsplat8(RUN_TINY_F32)));
    if (__builtin_expect(any8(exact), 0))
        return run_exact8(rows, n, el, mean, exact, v, (double)rvcap[0], (double)rvzero[0]);
    return v;
}

/* First loop of a group's statistics: the moments of its full 8-element vectors into L1
 * buffers (variance; the finite, identical, exact-zero and mean != 0 lane masks, four vectors
 * per 8 elements: storing them as they are costs less than packing them into one flag word
 * and unpacking it), so the second loop (classification and sums) runs with few live vectors
 * and no spilled accumulators. */
ALWAYS_INLINE void moments_pass8(const float *const *rows, int64_t n, int64_t full, float inv_n,
                                 float *restrict vbuf, vi8 *restrict fbuf,
                                 float *restrict mbuf, float *restrict rbuf, vi8 *zspread,
                                 const params_t *p, float *restrict qbuf) {
    const vf8 zero = vsplat8(0.0f);
    const vf8 rvcap = vsplat8((float)p->rvcap), rvzero = vsplat8((float)p->rvzero);
    vi8 zsp = (vi8){0};
    for (int64_t el = 0; el < full; el += 8) {
        vf8 mean, var;
        vi8 *f = fbuf + (el >> 3) * 4;
        moments8(rows, n, el, inv_n, &mean, &var, &f[0], &f[1], &f[2], 0);
        f[3] = f[0] & ~f[1] & (mean != zero); /* a measured variance: finite, not identical,
                                                * mean != 0 */
        vstore8(vbuf + el, var);
        if (mbuf) { /* the norms' terms, as clamped_pass8's; the run digits' variances */
            vstore8(mbuf + el, vsel8(f[0], mean, zero));
            vstore8(rbuf + el, vsel8(f[3], var, zero));
            zsp |= f[0] & ~f[1] & (mean == zero);
            vf8 w = vsel8(f[3], var, vsel8(f[0] & f[1], zero, vsplat8(INFINITY)));
            vstore8(qbuf + el, run_var8(rows, n, el, mean, var, f[3], w, rvcap, rvzero, 0));
        }
    }
    if (zspread) *zspread = zsp;
}

/* First loop of the statistics without digits: each element's variance clamped to [vcap,
 * vzero] (vcap for identical samples, vzero for a zero mean or a non-finite sample) into
 * vbuf, and two lane masks per 8 elements into fbuf: finite, and finite but not an exact
 * zero (what may be a computational zero). */
ALWAYS_INLINE void clamped_pass8(const float *const *rows, int64_t n, int64_t full, float inv_n,
                                 vf8 vcap, vf8 vzero, float *restrict vbuf,
                                 vi8 *restrict fbuf, const int finite_known,
                                 float *restrict mbuf, float *restrict rbuf, vi8 *zspread,
                                 const params_t *p, float *restrict qbuf) {
    const vf8 zero = vsplat8(0.0f);
    const vf8 rvcap = vsplat8((float)p->rvcap), rvzero = vsplat8((float)p->rvzero);
    vi8 zsp = (vi8){0};
    for (int64_t el = 0; el < full; el += 8) {
        vf8 mean, var;
        vi8 finite, identical, exact_zero;
        moments8(rows, n, el, inv_n, &mean, &var, &finite, &identical, &exact_zero,
                 finite_known);
        vi8 measured = finite & ~identical & (mean != zero);
        /* the variance or the class (identical: 0, the cap; otherwise inf, 0 digits), then
         * the clamps (of the digits, of the run digits) */
        vf8 w = vsel8(measured, var, vsel8(finite & identical, zero, vsplat8(INFINITY)));
        vstore8(vbuf + el, vmin8(vmax8(w, vcap), vzero));
        if (mbuf) { /* the norms' terms (extras): a finite mean; the measured spread; the run
                     * digits' variances */
            vstore8(mbuf + el, vsel8(finite, mean, zero));
            vstore8(rbuf + el, vsel8(measured, var, zero));
            zsp |= finite & ~identical & (mean == zero); /* spread without a relative one */
            vstore8(qbuf + el, run_var8(rows, n, el, mean, var, measured, w, rvcap, rvzero,
                                        finite_known));
        }
        fbuf[(el >> 3) * 2] = finite;
        fbuf[(el >> 3) * 2 + 1] = finite & ~exact_zero;
    }
    if (zspread) *zspread = zsp;
}

/* The flags of moments_pass8 for the 8 elements at el, as lane masks: finite, identical,
 * exact zero, measured (finite, not identical, mean != 0: the variance sets the digits). */
ALWAYS_INLINE void flags8(const vi8 *fbuf, int64_t el, vi8 *finite, vi8 *identical,
                          vi8 *exact_zero, vi8 *measured) {
    const vi8 *f = fbuf + (el >> 3) * 4;
    *finite = f[0];
    *identical = f[1];
    *exact_zero = f[2];
    *measured = f[3];
}

/* Per-element digits (written to dig) and their statistics. */
/* 8 lanes of a mask (-1 or 0) as 0/1 bytes (narrowed in registers, one 8-byte store) */
typedef int8_t vb8 __attribute__((vector_size(8)));
typedef int8_t vb32 __attribute__((vector_size(32)));
ALWAYS_INLINE void store_mask8(uint8_t *zm, vi8 m) {
    /* the low byte of each lane (a byte shuffle; __builtin_convertvector narrows lane by
     * lane through general registers) */
    vb32 v = (vb32)(m & 1);
#if defined(__clang__) || __GNUC__ >= 12
    vb8 b = __builtin_shufflevector(v, v, 0, 4, 8, 12, 16, 20, 24, 28);
    memcpy(zm, &b, sizeof b);
#else /* GCC < 12: the same bytes first in a full-width shuffle */
    vb32 b = __builtin_shuffle(v, (vb32){0, 4, 8, 12, 16, 20, 24, 28});
    memcpy(zm, &b, 8);
#endif
}

/* The end of a vector digit block: its L lanes' sums, counts, min and max into the running
 * statistics, then the group's tail (cnt % L elements) through the scalar block SCALAR. */
#define FINISH_LANES(FT, L, SCALAR)                                                             \
    if (full) {                                                                                 \
        double ssum = 0, szero = 0, snf = 0, mnv = *s_min, mxv = *s_max;                        \
        for (int l = 0; l < (L); l++) {                                                         \
            ssum += sum[l]; szero += zeros[l]; snf += nf[l];                                    \
            mnv = lo[l] < mnv ? lo[l] : mnv;                                                    \
            mxv = hi[l] > mxv ? hi[l] : mxv;                                                    \
        }                                                                                       \
        *s_sum += ssum; *s_zero += szero; *s_nf += snf; *s_min = mnv; *s_max = mxv;             \
    }                                                                                           \
    if (full < cnt) {                                                                           \
        const FT *tail[MAX_SAMPLES];                                                            \
        for (int64_t i = 0; i < n; i++) tail[i] = rows[i] + full;                               \
        SCALAR(tail, n, cnt - full, p, K, dig ? dig + full : NULL, zm ? zm + full : NULL,       \
               s_sum, s_min, s_max, s_zero, s_nf);                                              \
    }

/* One thread's running statistics of stats_block_f32_n, per lane: reduced to the six numbers
 * once per thread (acc8_finish), not once per group. The product of significands is folded
 * back to [1, 2) after each group (its exponent into esum); the integer counts move to
 * doubles before they could overflow. */
typedef struct {
    vf8 prod, maxv, minv;  /* of the clamped variances */
    vi8 esum, zeros, nf;
    double esum_d[8], zeros_d[8], nf_d[8];
    int64_t iters, since_flush;  /* 8-element vectors per lane: in all, since the last flush */
    /* the extras' norms of the elements measured here (want_norms): their sums, and how many
     * leading elements of the last group they cover (the extras block does the rest) */
    int want_norms;
    double nmsq, nvsq;
    int64_t normed;
    /* the same running statistics for fp64 samples (stats_block_f64_n), 4 lanes: the
     * exponents' sums in int64 lanes, which never need a flush */
    vd4 prod4, maxv4, minv4;
    vl4 esum4, zeros4, nf4;
    int64_t iters4;
    /* the expected run digits of the normed elements (run_var8, run_var4): the product of
     * their clamped variances as prod's (vectors per lane in riters, since the last flush of
     * resum in rsince), and the sum of their digits once the thread is done (acc8_finish) */
    vf8 rprod;
    vi8 resum;
    double resum_d[8];
    int64_t riters, rsince;
    vd4 rprod4;
    vl4 resum4;
    int64_t riters4;
    double nrun;
} acc8_t;

/* A group's product of the run digits' clamped variances (run_var8: significands multiplied,
 * exponents summed, the digits' trick) into the thread's running one (acc8_finish takes the
 * logarithm), for a group whose norms the digit loops measured (the extras block does the
 * others' run digits); run_product8 takes the product of `full` variances in qbuf. */
ALWAYS_INLINE void run_fold8(acc8_t *acc, vf8 prod, vi8 esum, int64_t full) {
    /* the group's product (< 2^16) times the running one (in [1, 2)): exponent out */
    vi8 b = (vi8)(prod * acc->rprod);
    esum += (b >> 23) - 127;
    acc->rprod = (vf8)((b & 0x007FFFFF) | 0x3F800000);
    acc->resum = esum;
    acc->riters += full / 8;
    if ((acc->rsince += full / 8) >= ((int64_t)1 << 22)) { /* int32 lanes: as acc8_flush */
        for (int l = 0; l < 8; l++) acc->resum_d[l] += acc->resum[l];
        acc->resum = (vi8){0};
        acc->rsince = 0;
    }
}

ALWAYS_INLINE void run_product8(acc8_t *acc, const float *restrict qbuf, int64_t full) {
    vf8 prod = vsplat8(1.0f);
    vi8 esum = acc->resum;
    for (int64_t el = 0; el < full; el += 8) {
        vi8 b = (vi8)vload8(qbuf + el);
        prod *= (vf8)((b & 0x007FFFFF) | 0x3F800000);
        esum += b >> 23; /* biased: 127 per vector comes off at the end */
    }
    run_fold8(acc, prod, esum, full);
}

/* The extras' norms of a group's first `full` elements from their moments (fp64 products):
 * mean^2, and s^2 = (relative spread, times n - 1) mean^2 / (n - 1) (mbuf: the finite means,
 * rbuf: the measured spreads); an element with a zero mean and a spread (zsp) has no relative
 * spread to give its s^2: the extras block then measures the group whole. 10% off round_stats
 * against a pass of its own. */
ALWAYS_INLINE void norms_from_moments(acc8_t *acc, const float *restrict mbuf,
                                      const float *restrict rbuf, int64_t full, int64_t n,
                                      vi8 zsp) {
    if (!full || any8(zsp)) return;
    double msq = 0, vsq = 0;
    _Pragma("omp simd reduction(+:msq, vsq)")
    for (int64_t el = 0; el < full; el++) {
        const double md = (double)mbuf[el], m2 = md * md;
        msq += m2;
        vsq += (double)rbuf[el] * m2;
    }
    acc->nmsq += msq;
    acc->nvsq += vsq / (double)(n - 1);
    acc->normed = full;
}

ALWAYS_INLINE void digits_block_f32_n(const float *const *rows, int64_t n, int64_t cnt,
                                      const params_t *p, double K, float *restrict dig,
                                      uint8_t *restrict zm, acc8_t *acc, double *s_sum,
                                      double *s_min, double *s_max, double *s_zero,
                                      double *s_nf) {
    const float inv_n = 1.0f / (float)n, cap = (float)p->cap;
    /* -0.5 log10(v / (n - 1)) + K: the division folds into the constant */
    const vf8 Kv = vsplat8((float)(K + 0.5 * log10((double)(n - 1))));
    const vf8 tiny = vsplat8(1.1754943508222875e-38f * (float)(n - 1));
    const vf8 zero = vsplat8(0.0f), capv = vsplat8(cap), thr = vsplat8((float)p->zero_threshold);
    vf8 sum = zero, lo = capv, hi = zero;
    vi8 zeros = (vi8){0}, nf = (vi8){0};
    int64_t full = cnt & ~(int64_t)7;
    /* two loops over the group, as in stats_block_f32_n */
    float vbuf[BLK], mbuf[BLK], rbuf[BLK], qbuf[BLK];
    vi8 fbuf[BLK / 2]; /* 4 masks per 8 elements */
    const int norms = acc->want_norms;
    vi8 zsp = (vi8){0};
    moments_pass8(rows, n, full, inv_n, vbuf, fbuf, norms ? mbuf : NULL, norms ? rbuf : NULL,
                  &zsp, p, qbuf);
    if (norms) norms_from_moments(acc, mbuf, rbuf, full, n, zsp);
    if (acc->normed) run_product8(acc, qbuf, full); /* the extras do the others' run digits */
    for (int64_t el = 0; el < full; el += 8) {
        vf8 var = vload8(vbuf + el);
        vi8 finite, identical, exact_zero, measured;
        flags8(fbuf, el, &finite, &identical, &exact_zero, &measured);
        vi8 mean_zero = finite & ~identical & ~measured;
        /* var = 0 -> log = -inf -> cap; NaN or inf -> 0; tiny -> above the cap */
        vi8 normal = (var >= tiny) & ((var - var) == zero);
        vf8 c = vlog10_8(vsel8(normal, var, vsplat8(1.0f))) * -0.5f + Kv;
        c = vsel8(normal, c, vsel8((var >= zero) & (var < tiny), capv, zero));
        c = vsel8(c > capv, capv, vsel8(c < zero, zero, c));
        c = vsel8(mean_zero, zero, c);
        c = vsel8(identical, capv, c);
        c = vsel8(finite, c, zero);
        vi8 is_zero = finite & ~exact_zero & (c < thr);
        zeros -= is_zero; /* masks are -1 */
        nf -= ~finite;
        sum += c;
        lo = vsel8(c < lo, c, lo);
        hi = vsel8(c > hi, c, hi);
        if (dig) vstore8(dig + el, c);
        if (zm) store_mask8(zm + el, is_zero);
    }
    FINISH_LANES(float, 8, digits_block_f32_scalar)
}

/* The same statistics without per-element digits, and without a logarithm per element: an
 * element's digits are K' - log10(v) / 2 with v its variance clamped to [vcap, vzero] (the
 * variances of the cap's digits and of 0 digits; vcap for identical samples, vzero for a zero
 * mean or a non-finite sample), so the clamps of the digits become clamps of variances, the
 * zero threshold a comparison, and the sum of the logarithms of all elements the logarithm of
 * their product, kept as a product of significands (< 2^16 over the 16 vectors of a group) and
 * a sum of exponents. One log10 per lane remains. */

static void acc8_init(acc8_t *a) {
    memset(a, 0, sizeof *a);
    a->prod = vsplat8(1.0f);
    a->minv = vsplat8(INFINITY);
    a->prod4 = vsplat4(1.0);
    a->minv4 = vsplat4(INFINITY);
    a->rprod = vsplat8(1.0f);
    a->rprod4 = vsplat4(1.0);
}

static void acc8_flush(acc8_t *a) {
    for (int l = 0; l < 8; l++) {
        a->esum_d[l] += a->esum[l]; a->zeros_d[l] += a->zeros[l]; a->nf_d[l] += a->nf[l];
    }
    a->esum = a->zeros = a->nf = (vi8){0};
    a->since_flush = 0;
}

/* The statistics of the accumulated lanes: an element's digits are Kd - log10(v) / 2, so a
 * lane's sum is iters Kd - (log10(product) + sum of exponents) / 2; its least and largest
 * digits come from its largest and least v, exactly 0 and the cap at the clamps. */
static void acc4_finish(acc8_t *a, const params_t *p, double *s_sum, double *s_min,
                        double *s_max, double *s_zero, double *s_nf);

static void acc8_finish(acc8_t *a, const params_t *p, float vcap, float vzero, double *s_sum,
                        double *s_min, double *s_max, double *s_zero, double *s_nf) {
    if (a->iters4) acc4_finish(a, p, s_sum, s_min, s_max, s_zero, s_nf);
    if (a->riters) { /* the run digits: rkd - log10(v) / 2 summed as the digits below (an
                      * exact logarithm of each lane's product: 8 per thread) */
        const double rit = (double)a->riters;
        for (int l = 0; l < 8; l++) a->resum_d[l] += a->resum[l];
        a->resum = (vi8){0};
        double run = 0;
        for (int l = 0; l < 8; l++)
            run += rit * p->rkd - 0.5 * (log10((double)a->rprod[l]) + 0.30102999566398120 *
                                         (a->resum_d[l] - 127.0 * rit));
        a->nrun += run;
    }
    if (a->iters == 0) return;
    acc8_flush(a);
    const double cap = p->cap, Kd = p->kd, it = (double)a->iters;
    vf8 lprod = vlog10_8(a->prod), lmax = vlog10_8(a->maxv), lmin = vlog10_8(a->minv);
    double ssum = 0, szero = 0, snf = 0, mnv = *s_min, mxv = *s_max;
    for (int l = 0; l < 8; l++) {
        /* esum holds biased exponents, one per vector */
        double logs = (double)lprod[l] + 0.30102999566398120 * (a->esum_d[l] - 127.0 * it);
        ssum += it * Kd - 0.5 * logs;
        szero += a->zeros_d[l];
        snf += a->nf_d[l];
        double lo = a->maxv[l] >= vzero ? 0 : a->maxv[l] <= vcap ? cap
                                             : Kd - 0.5 * (double)lmax[l];
        double hi = a->minv[l] <= vcap ? cap : a->minv[l] >= vzero ? 0
                                             : Kd - 0.5 * (double)lmin[l];
        lo = lo < 0 ? 0 : (lo > cap ? cap : lo);
        hi = hi < 0 ? 0 : (hi > cap ? cap : hi);
        mnv = lo < mnv ? lo : mnv;
        mxv = hi > mxv ? hi : mxv;
    }
    *s_sum += ssum; *s_zero += szero; *s_nf += snf; *s_min = mnv; *s_max = mxv;
}

ALWAYS_INLINE void stats_block_f32_n(const float *const *rows, int64_t n, int64_t cnt,
                                     const params_t *p, uint8_t *restrict zm, acc8_t *acc,
                                     double *s_sum, double *s_min, double *s_max,
                                     double *s_zero, double *s_nf, const int finite_known) {
    const float inv_n = 1.0f / (float)n;
    const float tiny_f = 1.1754943508222875e-38f * (float)(n - 1);
    /* the variances of the cap's digits, of 0 digits, of the zero threshold's */
    const vf8 vcap = vsplat8((float)p->vcap), vzero = vsplat8((float)p->vzero);
    const vf8 vthr = vsplat8((float)p->vthr);
    const vf8 one = vsplat8(1.0f);
    vf8 prod = one, maxv = acc->maxv, minv = acc->minv;
    vi8 esum = acc->esum, zeros = acc->zeros, nf = acc->nf;
    /* vcap is a normal float for every format that fits fp32 samples (its log is exact to
     * the float's precision); the general block otherwise */
    int64_t full = (float)p->vcap > tiny_f && (float)p->rvcap > tiny_f ? cnt & ~(int64_t)7 : 0;
    /* two loops over the group, each with few live vectors (no spilled accumulators): the
     * clamped variances and masks, kept in L1, then the sums */
    float vbuf[BLK], mbuf[BLK], rbuf[BLK], qbuf[BLK];
    vi8 fbuf[BLK / 4]; /* 2 masks per 8 elements */
    const int norms = acc->want_norms;
    vi8 zsp = (vi8){0};
    clamped_pass8(rows, n, full, inv_n, vcap, vzero, vbuf, fbuf, finite_known,
                  norms ? mbuf : NULL, norms ? rbuf : NULL, &zsp, p, qbuf);
    if (norms) norms_from_moments(acc, mbuf, rbuf, full, n, zsp);
    /* the run digits' product (run_product8) in this loop: kept where the norms were measured
     * here (the extras do the others' run digits) */
    vf8 rprod = one;
    vi8 resum = acc->resum;
    for (int64_t el = 0; el < full; el += 8) {
        vf8 v = vload8(vbuf + el);
        vi8 finite = fbuf[(el >> 3) * 2], maybe_zero = fbuf[(el >> 3) * 2 + 1];
        vi8 b = (vi8)v;
        prod *= (vf8)((b & 0x007FFFFF) | 0x3F800000);
        esum += b >> 23; /* biased: 127 per vector comes off at the end */
        if (norms) {
            vi8 q = (vi8)vload8(qbuf + el);
            rprod *= (vf8)((q & 0x007FFFFF) | 0x3F800000);
            resum += q >> 23;
        }
        maxv = vmax8(v, maxv);
        minv = vmin8(v, minv);
        /* computational zeros: fewer digits than the threshold, finite, not exact zeros */
        vi8 zmask = maybe_zero & (v > vthr);
        zeros -= zmask; /* masks are -1 */
        if (!finite_known) nf -= ~finite;
        if (zm) store_mask8(zm + el, zmask);
    }
    if (full) {
        /* the group's product (< 2^16) times the running one (in [1, 2)): exponent out */
        vi8 b = (vi8)(prod * acc->prod);
        esum += (b >> 23) - 127;
        acc->prod = (vf8)((b & 0x007FFFFF) | 0x3F800000);
        acc->maxv = maxv; acc->minv = minv;
        acc->esum = esum; acc->zeros = zeros; acc->nf = nf;
        acc->iters += full / 8;
        /* biased exponents <= 254 per vector: int32 lanes hold 2^22 vectors */
        if ((acc->since_flush += full / 8) >= ((int64_t)1 << 22)) acc8_flush(acc);
    }
    if (acc->normed) run_fold8(acc, rprod, resum, full);
    if (full < cnt) {
        const float *tail[MAX_SAMPLES];
        for (int64_t i = 0; i < n; i++) tail[i] = rows[i] + full;
        digits_block_f32_scalar(tail, n, cnt - full, p, log10(sqrt((double)n) / p->t), NULL,
                                zm ? zm + full : NULL, s_sum, s_min, s_max, s_zero, s_nf);
    }
}

/* The usual sample counts as compile-time constants: the sample loops unroll and each
 * element's samples stay in registers between the two passes. Not inlined: one copy serves
 * the seven mode bodies (a call per 128-element group costs nothing measurable, and inlining
 * it into every body tripled the compile time, to about a minute). */
NOINLINE void digits_block_f32(const float *const *rows, int64_t n, int64_t cnt, const params_t *p,
                               double K, float *restrict dig, uint8_t *restrict zm, acc8_t *acc,
                               double *s_sum, double *s_min, double *s_max, double *s_zero,
                               double *s_nf, int finite) {
    /* finite: every sample row was rounded by the short path (no inf or NaN to look for) */
    if (dig == NULL) {
        if (n == 3 && finite)
            stats_block_f32_n(rows, 3, cnt, p, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 1);
        else if (n == 3)
            stats_block_f32_n(rows, 3, cnt, p, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
        else if (n == 2)
            stats_block_f32_n(rows, 2, cnt, p, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
        else
            stats_block_f32_n(rows, n, cnt, p, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
    } else if (n == 3)
        digits_block_f32_n(rows, 3, cnt, p, K, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf);
    else if (n == 2)
        digits_block_f32_n(rows, 2, cnt, p, K, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf);
    else
        digits_block_f32_n(rows, n, cnt, p, K, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf);
}

/* ---------------------------------------------------------------------------------------
 * fp64 statistics and digits, four lanes at a time (AVX2 holds 4 doubles).
 */

/* The clamped variance of 4 fp64 elements (the variance of their digits: vcap for identical
 * samples, vzero for a zero mean with spread, a non-finite sample or a NaN variance) and its
 * masks: finite; finite and not an exact zero; measured (finite, not identical, mean != 0);
 * a zero mean with spread. */
ALWAYS_INLINE vd4 clamped4(const double *const *rows, int64_t n, int64_t el, double inv_n,
                           vd4 vcap, vd4 vzero, vd4 *mean, vd4 *var, vl4 *finite,
                           vl4 *maybe_zero, vl4 *measured, vl4 *zero_mean, vd4 *w_,
                           const int finite_known) {
    const vd4 zero = vsplat4(0.0);
    vl4 identical, exact_zero;
    moments4(rows, n, el, inv_n, mean, var, finite, &identical, &exact_zero, finite_known);
    *measured = *finite & ~identical & (*mean != zero) & (*var == *var);
    *maybe_zero = *finite & ~exact_zero;
    *zero_mean = *finite & ~identical & (*mean == zero);
    /* the variance or the class (identical: 0, the cap; otherwise inf, 0 digits), clamped */
    const vd4 w = vsel4(*measured, *var, vsel4(*finite & identical, zero, vsplat4(INFINITY)));
    *w_ = w;
    return vsel4(w < vcap, vcap, vsel4(w > vzero, vzero, w));
}

/* log10 of 4 positive normal doubles: 2 atanh((m-1)/(m+1)) series on m in [sqrt(1/2),
 * sqrt(2)), absolute error below 1e-14 */
ALWAYS_INLINE vd4 vlog10_pos4(vd4 v) {
    vl4 b = (vl4)v;
    vl4 e = ((b >> 52) & 0x7FF) - 1023;
    vd4 m = (vd4)((b & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll);
    vl4 big = m > vsplat4(1.4142135623730951);
    m = vsel4(big, vsplat4(0.5) * m, m);
    e -= big; /* big is -1 where true */
    vd4 s = (m - 1.0) / (m + 1.0), s2 = s * s;
    vd4 ln = 2.0 * s * (1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9
             + s2 * (1.0 / 11 + s2 * (1.0 / 13 + s2 * (1.0 / 15))))))));
    /* (double)e exactly: |e| < 2^51 added to the bits of 1.5 2^52 */
    vd4 ed = (vd4)(e + 0x4338000000000000ll) - 6755399441055744.0;
    return (ln + ed * 0.69314718055994530942) * 0.43429448190325182765;
}

/* The digits of 4 clamped variances, kd - log10(v) / 2, exactly the cap at vcap and 0 at
 * vzero (v lies between them: normal numbers). Lane by lane, so an element's digits are the
 * same bits whichever vector holds it. */
ALWAYS_INLINE vd4 digits4_f64(vd4 v, vd4 kd, vd4 vcap, vd4 vzero, vd4 cap) {
    const vd4 zero = vsplat4(0.0);
    vd4 c = kd - 0.5 * vlog10_pos4(v);
    c = vsel4(c > cap, cap, vsel4(c < zero, zero, c));
    c = vsel4(v >= vzero, zero, c);
    return vsel4(v <= vcap, cap, c);
}

/* run_exact8 for 4 fp64 elements */
NOINLINE vd4 run_exact4(const double *const *rows, int64_t n, int64_t el, vd4 mean, vl4 exact,
                        vd4 v, double rvcap_d, double rvzero_d) {
    const double inv_n1 = 1.0 / (double)(n - 1), n1 = (double)(n - 1);
    const vd4 rvcap = vsplat4(rvcap_d), rvzero = vsplat4(rvzero_d), zero = vsplat4(0.0);
    const vd4 x0 = vload4(rows[0] + el);
    vd4 ss = zero;
    vl4 same = (vl4){0} - 1;
    for (int64_t i = 0; i < n; i++) {
        const vd4 x = vload4(rows[i] + el), d = x - mean;
        ss += d * d;
        same &= x == x0;
    }
    ss = ss * inv_n1;
    const vd4 m2 = mean * mean;
    const vl4 fin = ((m2 - m2) == zero) & ((ss - ss) == zero);
    vd4 q = ss / m2 * n1;
    q = vsel4(q < rvcap, rvcap, vsel4(q > rvzero, rvzero, q));
    q = vsel4((q == q) & (m2 != zero), q, rvzero);
    q = vsel4(same, rvcap, q);
    return vsel4(exact, vsel4(fin, q, rvzero), v);
}

/* The run digits' clamped variance of 4 fp64 elements (as run_var8): the reference's mean^2
 * and s^2 are fp64 products that overflow beyond |mean| ~ 1.3e154 (then the element counts
 * as non-finite: 0 digits) and lose their precision below ~1e-139 (where v meets the cap's
 * variance), and its s^2 about the rounded mean reads n / (n - 1) (its error)^2 <= 3 2^-100
 * mean^2 more: lanes of |mean| beyond [2^-450, 2^500] or var / (n - 1) below 2^-62 (1e-11
 * relative) take its own arithmetic (run_exact4). */
ALWAYS_INLINE vd4 run_var4(const double *const *rows, int64_t n, int64_t el, vd4 mean, vd4 var,
                           vl4 finite, vl4 measured, vd4 w, vd4 rvcap, vd4 rvzero) {
    /* w: the variances with the classes of the digits' clamp (clamped4); a mean that
     * overflowed (finite samples) lies beyond RUN_HUGE_F64 */
    const vd4 v = vsel4(w < rvcap, rvcap, vsel4(w > rvzero, rvzero, w));
    const vd4 am = (vd4)((vl4)mean & 0x7FFFFFFFFFFFFFFFll);
    const vl4 exact = finite & ((am > vsplat4(RUN_HUGE_F64)) |
                             (measured & ~((var >= vsplat4(RUN_EXACT_F64 * (double)(n - 1))) &
                                           (am >= vsplat4(RUN_TINY_F64)))));
    if (__builtin_expect(any4(exact), 0))
        return run_exact4(rows, n, el, mean, exact, v, rvcap[0], rvzero[0]);
    return v;
}

/* run_fold8 for fp64 lanes (stats_block_f64_n multiplies them): int64 exponent sums, no
 * flush */
typedef uint64_t vu4 __attribute__((vector_size(32)));
ALWAYS_INLINE void run_fold4(acc8_t *acc, vd4 prod, vl4 esum, int64_t full) {
    /* the group's product (< 2^32) times the running one (in [1, 2)): exponent out */
    vl4 b = (vl4)(prod * acc->rprod4);
    esum += (b >> 52) - 1023;
    acc->rprod4 = (vd4)((b & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll);
    acc->resum4 = esum;
    acc->riters4 += full / 4;
}

/* fp64 statistics, and per-element digits into `dig` if given, as stats_block_f32_n: each
 * element's clamped variance (clamped4), the sum of the digits from the running product of
 * the variances' significands and the sum of their exponents: no logarithm per element for
 * the statistics, so they are the same with or without digits. Two loops over the group, as
 * the fp32 block: the clamped variances and two masks per 4 elements into L1 buffers (and the
 * extras' norms' terms), then the sums; then the digits (digits4_f64). `finite_known` when
 * every sample row took the rounding's short path. The last cnt % 4 elements go through the
 * same vector code on a padded copy, so their digits are the bits they would have in a lane.
 * The clamps are those of the digits, so min, max and the computational zeros agree with the
 * per-element digits; the sum agrees with theirs to ~1e-13 relative (tests/test_native.py).
 * 1.2x faster than one loop over moments4 (a min, a max and a second pass over the samples
 * per element) and its scalar twin for the tail, which it replaces. */
ALWAYS_INLINE void stats_block_f64_n(const double *const *rows, int64_t n, int64_t cnt,
                                     const params_t *p, double *restrict dig,
                                     uint8_t *restrict zm, acc8_t *acc, double *s_sum,
                                     double *s_min, double *s_max, double *s_zero,
                                     double *s_nf, const int finite_known) {
    const double inv_n = 1.0 / (double)n;
    const vd4 zero = vsplat4(0.0), one = vsplat4(1.0);
    const vd4 vcap = vsplat4(p->vcap), vzero = vsplat4(p->vzero), vthr = vsplat4(p->vthr);
    const vd4 kd = vsplat4(p->kd), capv = vsplat4(p->cap);
    const int64_t full = cnt & ~(int64_t)3;
    const vd4 rvcap = vsplat4(p->rvcap), rvzero = vsplat4(p->rvzero);
    double vbuf[BLK], mbuf[BLK], rbuf[BLK], qbuf[BLK];
    vl4 fbuf[BLK / 2]; /* finite; finite and not an exact zero: per 4 elements */
    const int norms = acc->want_norms;
    vl4 zsp = (vl4){0};
    for (int64_t el = 0; el < full; el += 4) {
        vd4 mean, var, w;
        vl4 finite, maybe_zero, measured, zero_mean;
        vstore4(vbuf + el, clamped4(rows, n, el, inv_n, vcap, vzero, &mean, &var, &finite,
                                    &maybe_zero, &measured, &zero_mean, &w, finite_known));
        if (norms) { /* the norms' terms, as clamped_pass8's; the run digits' variances */
            vstore4(mbuf + el, vsel4(finite, mean, zero));
            vstore4(rbuf + el, vsel4(measured, var, zero));
            zsp |= zero_mean;
            vstore4(qbuf + el, run_var4(rows, n, el, mean, var, finite, measured, w, rvcap,
                                        rvzero));
        }
        fbuf[(el >> 2) * 2] = finite;
        fbuf[(el >> 2) * 2 + 1] = maybe_zero;
    }
    if (norms && full && !any4(zsp)) {
        /* as the extras block: an element whose mean^2 or s^2 overflows adds to neither */
        const double inv_n1 = 1.0 / (double)(n - 1);
        double msq = 0, vsq = 0;
        _Pragma("omp simd reduction(+:msq, vsq)")
        for (int64_t el = 0; el < full; el++) {
            const double m2 = mbuf[el] * mbuf[el], s2 = rbuf[el] * m2 * inv_n1;
            const int finite = (m2 - m2 == 0) & (s2 - s2 == 0);
            msq += finite ? m2 : 0.0;
            vsq += finite ? s2 : 0.0;
        }
        acc->nmsq += msq;
        acc->nvsq += vsq;
        acc->normed = full;
    }
    /* the run digits' product (run_product4) in this loop: kept where the norms were measured
     * here (the extras do the others' run digits) */
    vd4 prod = one, maxv = acc->maxv4, minv = acc->minv4, rprod = one;
    vl4 esum = acc->esum4, zeros = acc->zeros4, nf = acc->nf4, resum = acc->resum4;
    for (int64_t el = 0; el < full; el += 4) {
        vd4 v = vload4(vbuf + el);
        vl4 finite = fbuf[(el >> 2) * 2], maybe_zero = fbuf[(el >> 2) * 2 + 1];
        vl4 b = (vl4)v;
        prod *= (vd4)((b & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll);
        esum += b >> 52; /* biased: 1023 per element comes off at the end */
        if (norms) {
            vl4 q = (vl4)vload4(qbuf + el);
            rprod *= (vd4)((q & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll);
            resum += (vl4)((vu4)q >> 52); /* positive: a logical shift */
        }
        maxv = vsel4(v > maxv, v, maxv);
        minv = vsel4(v < minv, v, minv);
        /* computational zeros: fewer digits than the threshold, finite, not exact zeros */
        vl4 zmask = maybe_zero & (v > vthr);
        zeros -= zmask; /* masks are -1 */
        if (!finite_known) nf -= ~finite;
        if (zm)
            for (int l = 0; l < 4; l++) zm[el + l] = (uint8_t)(zmask[l] & 1);
    }
    if (full) {
        /* the group's product (< 2^32) times the running one (in [1, 2)): exponent out */
        vl4 b = (vl4)(prod * acc->prod4);
        esum += (b >> 52) - 1023;
        acc->prod4 = (vd4)((b & 0x000FFFFFFFFFFFFFll) | 0x3FF0000000000000ll);
        acc->maxv4 = maxv; acc->minv4 = minv;
        acc->esum4 = esum; acc->zeros4 = zeros; acc->nf4 = nf;
        acc->iters4 += full / 4;
    }
    if (acc->normed) run_fold4(acc, rprod, resum, full);
    if (dig)
        for (int64_t el = 0; el < full; el += 4)
            vstore4(dig + el, digits4_f64(vload4(vbuf + el), kd, vcap, vzero, capv));
    if (full < cnt) { /* the last 1-3 elements, padded with the last one to a vector */
        const int64_t rem = cnt - full;
        double pad[MAX_SAMPLES][4];
        const double *prow[MAX_SAMPLES];
        for (int64_t i = 0; i < n; i++) {
            for (int64_t l = 0; l < 4; l++) pad[i][l] = rows[i][full + (l < rem ? l : rem - 1)];
            prow[i] = pad[i];
        }
        vd4 mean, var, w;
        vl4 finite, maybe_zero, measured, zero_mean;
        vd4 v = clamped4(prow, n, 0, inv_n, vcap, vzero, &mean, &var, &finite, &maybe_zero,
                         &measured, &zero_mean, &w, finite_known);
        vd4 d = digits4_f64(v, kd, vcap, vzero, capv);
        double ssum = 0, mnv = *s_min, mxv = *s_max, szero = 0, snf = 0;
        for (int64_t l = 0; l < rem; l++) {
            const int is_zero = (int)(maybe_zero[l] & 1) & (v[l] > p->vthr);
            ssum += d[l];
            mnv = d[l] < mnv ? d[l] : mnv;
            mxv = d[l] > mxv ? d[l] : mxv;
            szero += is_zero;
            snf += !(finite[l] & 1);
            if (zm) zm[full + l] = (uint8_t)is_zero;
            if (dig) dig[full + l] = d[l];
        }
        *s_sum += ssum; *s_min = mnv; *s_max = mxv; *s_zero += szero; *s_nf += snf;
    }
}

/* The fp64 lanes' statistics (stats_block_f64_n), as acc8_finish does the fp32 ones. */
static void acc4_finish(acc8_t *a, const params_t *p, double *s_sum, double *s_min,
                        double *s_max, double *s_zero, double *s_nf) {
    const double cap = p->cap, Kd = p->kd, it = (double)a->iters4, rit = (double)a->riters4;
    if (a->riters4) /* the run digits (run_product4) */
        for (int l = 0; l < 4; l++)
            a->nrun += rit * p->rkd - 0.5 * (log10(a->rprod4[l]) + 0.30102999566398120 *
                                             ((double)a->resum4[l] - 1023.0 * rit));
    double ssum = 0, szero = 0, snf = 0, mnv = *s_min, mxv = *s_max;
    for (int l = 0; l < 4; l++) {
        double logs = log10(a->prod4[l]) + 0.30102999566398120 *
                      ((double)a->esum4[l] - 1023.0 * it);
        ssum += it * Kd - 0.5 * logs;
        szero += (double)a->zeros4[l];
        snf += (double)a->nf4[l];
        double lo = a->maxv4[l] >= p->vzero ? 0 : a->maxv4[l] <= p->vcap ? cap
                                               : Kd - 0.5 * log10(a->maxv4[l]);
        double hi = a->minv4[l] <= p->vcap ? cap : a->minv4[l] >= p->vzero ? 0
                                               : Kd - 0.5 * log10(a->minv4[l]);
        lo = lo < 0 ? 0 : (lo > cap ? cap : lo);
        hi = hi < 0 ? 0 : (hi > cap ? cap : hi);
        mnv = lo < mnv ? lo : mnv;
        mxv = hi > mxv ? hi : mxv;
    }
    *s_sum += ssum; *s_zero += szero; *s_nf += snf; *s_min = mnv; *s_max = mxv;
}

/* fp64: the statistics, with per-element digits or not; not inlined either */
NOINLINE void digits_block_f64(const double *const *rows, int64_t n, int64_t cnt, const params_t *p,
                               double K, double *restrict dig, uint8_t *restrict zm, acc8_t *acc,
                               double *s_sum, double *s_min, double *s_max, double *s_zero,
                               double *s_nf, int finite) {
    /* finite: every sample row was rounded by the short path (no inf or NaN to look for) */
    (void)K;
    if (n == 3 && finite)
        stats_block_f64_n(rows, 3, cnt, p, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 1);
    else if (n == 3)
        stats_block_f64_n(rows, 3, cnt, p, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
    else if (n == 2)
        stats_block_f64_n(rows, 2, cnt, p, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
    else
        stats_block_f64_n(rows, n, cnt, p, dig, zm, acc, s_sum, s_min, s_max, s_zero, s_nf, 0);
}

/* Random bits (random mode) or words (stochastic mode) of sample i for elements e0..e0+cnt-1
 * of group g (e0 = 128 g): fxstab.numerics.randbits.random_bits / uniform_words. */
ALWAYS_INLINE void sample_bits(const params_t *p, const int mode, int64_t g, int64_t cnt,
                               int64_t i, const int *draws, const int *flips,
                               uint32_t (*dwords)[4], uint32_t (*swords)[PHILOX_LANES],
                               uint32_t *rb) {
    if (mode == MODE_RANDOM) {
        const uint32_t *w = dwords[draws[i]];
        uint32_t f = (uint32_t)flips[i];
        for (int q = 0; q < 4; q++) {  /* a full 128-element group, even past cnt */
            uint32_t wq = w[q];
            for (int b = 0; b < 32; b++) rb[q * 32 + b] = ((wq >> b) & 1) ^ f;
        }
    } else if (mode == MODE_STOCHASTIC) {
        /* one evaluation serves draws 4b..4b+3: computed when sample i opens block b */
        if ((i & 3) == 0) {
            for (int64_t el = 0; el < cnt; el++) {
                uint64_t e = (uint64_t)(g * BLK + el);
                swords[0][el] = (uint32_t)e; swords[1][el] = (uint32_t)(i >> 2);
                swords[2][el] = (uint32_t)(e >> 32); swords[3][el] = 0;
            }
            philox_lanes(p->seed, swords, (int)cnt);
        }
        for (int64_t el = 0; el < cnt; el++) rb[el] = swords[i & 3][el];
    } else {
        for (int64_t el = 0; el < cnt; el++) rb[el] = 0;
    }
}

/* ---------------------------------------------------------------------------------------
 * GEMM surrogate (fxstab.numerics.surrogate.perturb_samples): element e is perturbed when
 * max_k |x_k - mean| <= eta * |mean|; sample k then becomes x_k * (1 + eta * r), r =
 * (2 b + 1) 2^-8 - 1 with b byte e % 4 of word (e / 4) % 4 of philox(seed, e / 16, k, ...).
 * Returns the number of perturbed elements.
 */
/* Which of the cnt elements at e0 are insufficiently separated (close), their means, and how
 * many of them are close and not all zero (moving: the only ones the perturbation changes). */
#define DEFINE_CLOSE_BLOCK(NAME, FT)                                                            \
    ALWAYS_INLINE void NAME(const FT *x, int64_t xs, int64_t n, int64_t e0, int64_t cnt,      \
                            FT eta, FT *restrict mean, int *restrict close, int64_t *count,   \
                            int64_t *moving) {                                                  \
        FT spread[BLK];                                                                         \
        const FT fn = (FT)n;                                                                    \
        for (int64_t el = 0; el < cnt; el++) { mean[el] = 0; spread[el] = 0; }                  \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const FT *restrict xi = x + i * xs + e0;                                            \
            for (int64_t el = 0; el < cnt; el++) mean[el] += xi[el];                            \
        }                                                                                       \
        for (int64_t el = 0; el < cnt; el++) mean[el] = mean[el] / fn; /* torch's mean */       \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const FT *restrict xi = x + i * xs + e0;                                            \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                FT d = xi[el] - mean[el];                                                       \
                d = d < 0 ? -d : d;                                                             \
                /* amax propagates NaN */                                                       \
                spread[el] = (d > spread[el] || d != d) && spread[el] == spread[el]             \
                             ? d : spread[el];                                                  \
            }                                                                                   \
        }                                                                                       \
        int64_t c = 0, mv = 0;                                                                  \
        for (int64_t el = 0; el < cnt; el++) {                                                  \
            FT am = mean[el] < 0 ? -mean[el] : mean[el];                                        \
            close[el] = spread[el] <= eta * am;                                                 \
            c += close[el];                                                                     \
            mv += close[el] & (mean[el] != 0); /* close and 0: all samples are 0 */             \
        }                                                                                       \
        *count = c;                                                                             \
        *moving = mv;                                                                           \
    }

DEFINE_CLOSE_BLOCK(close_block_f32, float)
DEFINE_CLOSE_BLOCK(close_block_f64, double)

/* Sample by sample, the perturbed values of group g (cnt elements at e0) into out: x_k * (1 +
 * eta r) where close, x_k elsewhere; x and out may be the same rows (each value is read before
 * it is written). With a grid, a perturbed value is then rounded onto it stochastically,
 * saturating, with the 16-bit uniform of fxstab.numerics.randbits.random_halves (half e % 2 of
 * word (e / 2) % 4 of philox(derive_seed(seed, GRID_SALT), e / 8, k, ...)) as the top of the
 * 32-bit word. */
#define DEFINE_PERTURB_GROUP(NAME, FT, UT, ROUND)                                               \
    ALWAYS_INLINE void NAME(const FT *x, int64_t xs, FT *out, int64_t n, int64_t numel,        \
                            int64_t g, int64_t e0, int64_t cnt, FT eta, uint64_t seed,          \
                            const int *close, int64_t moving, const grid_t *grid) {             \
        FT fac[BLK];                                                                            \
        uint32_t rec[BLK / 4];                                                                  \
        uint32_t w[4][PHILOX_LANES];                                                            \
        uint32_t hw[4][PHILOX_LANES]; /* the grid rounding's words, 16 lanes per sample */     \
        const int on_grid = grid != NULL && grid->on;                                           \
        const uint64_t gseed = on_grid ? derive1(seed, GRID_SALT) : 0;                          \
        const rp_t gr = {on_grid ? grid->man_bits : 0, on_grid ? grid->k : 0,                   \
                         on_grid ? grid->max_bits : 0, on_grid ? grid->min_sub_bits : 0,        \
                         on_grid ? grid->finite_only : 0, 1};                                   \
        const int nq = (int)((cnt + 15) / 16);                                                  \
        /* the counters of every sample's records in one Philox run when they fit (8 lanes */  \
        /* per sample: N <= 16), else one run per sample */                                     \
        const int64_t per_run = n * nq <= PHILOX_LANES ? n : 1;                                 \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const FT *xi = x + i * xs + e0;                                                     \
            FT *oi = out + i * numel + e0;                                                      \
            if (moving == 0) { /* nothing to perturb, or only exact zeros: 0 * f == 0 */        \
                if (oi != xi) memcpy(oi, xi, (size_t)cnt * sizeof(FT));                         \
                continue;                                                                       \
            }                                                                                   \
            const int64_t slot = i % per_run; /* sample i's lanes: slot * nq ... */             \
            if (slot == 0) {                                                                    \
                int lanes = 0;                                                                  \
                for (int64_t j = i; j < i + per_run && j < n; j++)                              \
                    for (int q = 0; q < nq; q++, lanes++) {                                     \
                        uint64_t gg = (uint64_t)(g * (BLK / 16) + q);                           \
                        w[0][lanes] = (uint32_t)gg; w[1][lanes] = (uint32_t)j;                  \
                        w[2][lanes] = (uint32_t)(gg >> 32); w[3][lanes] = 0;                    \
                    }                                                                           \
                philox_lanes(seed, w, lanes);                                                   \
            }                                                                                   \
            /* element 16 q + b takes byte b of the 16-byte record (w0..w3 of counter q,       \
             * little-endian): stored record after record, the bytes are in element order */   \
            for (int q = 0; q < nq; q++)                                                        \
                for (int wd = 0; wd < 4; wd++) rec[q * 4 + wd] = w[wd][slot * nq + q];          \
            const uint8_t *rb = (const uint8_t *)rec;                                           \
            if (!on_grid) {                                                                     \
                for (int64_t el = 0; el < cnt; el++) {                                          \
                    FT r = (FT)(2 * (int)rb[el] + 1) * (FT)(1.0 / 256.0) - (FT)1;               \
                    fac[el] = (FT)1 + eta * r;                                                  \
                    FT v = xi[el];                                                              \
                    oi[el] = close[el] ? v * fac[el] : v;                                       \
                }                                                                               \
                continue;                                                                       \
            }                                                                                   \
            const int nh = (int)((cnt + 7) / 8);                                                \
            for (int q = 0; q < nh; q++) {                                                      \
                uint64_t gg = (uint64_t)(g * (BLK / 8) + q);                                    \
                hw[0][q] = (uint32_t)gg; hw[1][q] = (uint32_t)i;                                \
                hw[2][q] = (uint32_t)(gg >> 32); hw[3][q] = 0;                                  \
            }                                                                                   \
            philox_lanes(gseed, hw, nh);                                                        \
            for (int64_t el = 0; el < cnt; el++) {                                              \
                FT r = (FT)(2 * (int)rb[el] + 1) * (FT)(1.0 / 256.0) - (FT)1;                   \
                FT v = xi[el], y = v * ((FT)1 + eta * r);                                       \
                uint32_t word = (hw[(el >> 1) & 3][el >> 3] >> (16 * (el & 1))) << 16;          \
                UT b;                                                                           \
                memcpy(&b, &y, sizeof b);                                                       \
                b = ROUND(b, gr, MODE_STOCHASTIC, word);                                        \
                memcpy(&y, &b, sizeof b);                                                       \
                oi[el] = close[el] ? y : v;                                                     \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_PERTURB_GROUP(perturb_group_f32, float, uint32_t, round_f32)
DEFINE_PERTURB_GROUP(perturb_group_f64, double, uint64_t, round_f64)

/* ---------------------------------------------------------------------------------------
 * The arithmetic level's usual primitive computed inside round_stats (fxstab.cpu.bindings.Binary):
 * an elementwise add, sub, mul or div of two operands in the samples' dtype, broadcast as torch
 * broadcasts them, one IEEE operation per element (what torch's CPU kernel computes: the same
 * bits), block by block into the rounding of the row it belongs to. The output [n, numel] is
 * collapsed to [size0, size1, size2] per sample; an operand's element (i0, i1, i2) of sample k
 * is at k * as + i0 * ast[0] + i1 * ast[1] + i2 * ast[2] (strides 0 where it broadcasts).
 */
#define BIN_ADD 0
#define BIN_SUB 1
#define BIN_MUL 2
#define BIN_DIV 3
typedef struct {
    const void *a, *b;
    int64_t as, bs; /* sample strides, in elements (0: every sample reads the same values) */
    int64_t op;     /* BIN_* */
    int64_t size1, size2;
    int64_t ast[3], bst[3];
} binop_t;

#define BINARY_RUN(FT, OP)                                                                      \
    if (a2 == 1 && b2 == 1)                                                                     \
        for (int64_t k = 0; k < run; k++) o[k] = pa[k] OP pb[k];                                \
    else if (a2 == 1 && b2 == 0) {                                                              \
        const FT vb = pb[0];                                                                    \
        for (int64_t k = 0; k < run; k++) o[k] = pa[k] OP vb;                                   \
    } else if (a2 == 0 && b2 == 1) {                                                            \
        const FT va = pa[0];                                                                    \
        for (int64_t k = 0; k < run; k++) o[k] = va OP pb[k];                                   \
    } else                                                                                      \
        for (int64_t k = 0; k < run; k++) o[k] = pa[k * a2] OP pb[k * b2];

/* Where element e0 lies in the collapsed output: a cursor the blocks move along (one
 * division per sample and superblock, none per block). */
typedef struct {
    int64_t i0, i1, i2;
} bcur_t;

ALWAYS_INLINE bcur_t binary_cursor(const binop_t *bo, int64_t e0) {
    const int64_t r = e0 / bo->size2;
    return (bcur_t){r / bo->size1, r % bo->size1, e0 % bo->size2};
}

/* Sample i's values of the cnt elements at the cursor into t; moves the cursor past them. */
#define DEFINE_BINARY_BLOCK(NAME, FT)                                                           \
    ALWAYS_INLINE void NAME(const binop_t *bo, int64_t i, int64_t cnt, FT *restrict t,         \
                            bcur_t *cur) {                                                      \
        const FT *A = (const FT *)bo->a + i * bo->as, *B = (const FT *)bo->b + i * bo->bs;      \
        const int64_t s1 = bo->size1, s2 = bo->size2, a2 = bo->ast[2], b2 = bo->bst[2];         \
        int64_t i0 = cur->i0, i1 = cur->i1, i2 = cur->i2;                                       \
        for (int64_t el = 0; el < cnt;) {                                                       \
            int64_t run = s2 - i2 < cnt - el ? s2 - i2 : cnt - el;                              \
            const FT *pa = A + i0 * bo->ast[0] + i1 * bo->ast[1] + i2 * a2;                     \
            const FT *pb = B + i0 * bo->bst[0] + i1 * bo->bst[1] + i2 * b2;                     \
            FT *restrict o = t + el;                                                            \
            switch (bo->op) {                                                                   \
            case BIN_ADD: { BINARY_RUN(FT, +) } break;                                          \
            case BIN_SUB: { BINARY_RUN(FT, -) } break;                                          \
            case BIN_MUL: { BINARY_RUN(FT, *) } break;                                          \
            default: { BINARY_RUN(FT, /) } break;                                               \
            }                                                                                   \
            el += run;                                                                          \
            i2 += run;                                                                          \
            if (i2 == s2) {                                                                     \
                i2 = 0;                                                                         \
                if (++i1 == s1) { i1 = 0; i0++; }                                               \
            }                                                                                   \
        }                                                                                       \
        *cur = (bcur_t){i0, i1, i2};                                                            \
    }

DEFINE_BINARY_BLOCK(binary_block_f32, float)
DEFINE_BINARY_BLOCK(binary_block_f64, double)

/* ---------------------------------------------------------------------------------------
 * round_stats: round (mode != MODE_NONE) the n samples of each element into `out` and
 * accumulate stats[12] = [sum of digits, min, max, computational zeros, non-finite, numel,
 * squared norm of the means, squared norm of the standard deviations, underflowed elements,
 * p10 and p50 of the digits, the expected digits of a round-to-nearest run summed]
 * (stats may be NULL: rounding only); per-element digits into `dig` when not NULL.
 * Work is split into groups of 128 elements: one Philox evaluation per group and draw gives
 * the random bits of the whole group.
 */
/* A call of round_stats: what its parallel region reads (FT pointers as void). */
typedef struct {
    const void *x;
    void *out, *dig;
    int64_t xs, n, numel, groups, qstride, sbg, n_sb;
    const params_t *p;
    fused_t *fused;
    const int *draws, *flips;
    int n_free, want_stats, want_ext, fuse, nt;
    rp_t r;
    double K, eta;
    uint8_t *zm;
    ext_t *total;
    const binop_t *bin; /* the primitive computed in the kernel (x unused), or NULL */
} rs_call_t;

/* The parallel region of round_stats, NAME_region: run by each thread of an OpenMP team (its
 * worksharing loop shares the superblocks; the sums are the thread's private copies), or
 * called directly with one thread, where an OpenMP region with a team of one would cost about
 * 1 us, more than the work of a tiny tensor (then the loop runs every superblock and `ext` is
 * the total itself). */
#define DEFINE_RS_REGION(NAME, FT, ROW, DIGITS, EXTRAS, CLOSE, PERTURB_GROUP, BINARY, MODE)      \
    NOINLINE void NAME##_region(const rs_call_t *a, double *s_sum, double *s_min,               \
                                double *s_max, double *s_zero, double *s_nf,                    \
                                int64_t *n_close) {                                             \
        const FT *x = (const FT *)a->x;                                                         \
        FT *out = (FT *)a->out, *dig = (FT *)a->dig;                                            \
        const int64_t xs = a->xs, n = a->n, numel = a->numel, groups = a->groups;               \
        const int64_t qstride = a->qstride, sbg = a->sbg, n_sb = a->n_sb;                       \
        const params_t *p = a->p;                                                               \
        fused_t *fused = a->fused;                                                              \
        const int *draws = a->draws, *flips = a->flips;                                         \
        const int n_free = a->n_free, want_stats = a->want_stats, want_ext = a->want_ext;       \
        const int fuse = a->fuse, nt = a->nt, mode = MODE;                                      \
        const rp_t r = a->r;                                                                    \
        const double K = a->K;                                                                  \
        uint8_t *zm = a->zm;                                                                    \
        ext_t *total = a->total;                                                                \
        const binop_t *bin = a->bin;                                                            \
        const FT eta = (FT)a->eta;                                                              \
        {                                                                                       \
        acc8_t acc;                                                                             \
        acc8_init(&acc);                                                                        \
        acc.want_norms = want_ext;                                                              \
        /* one thread accumulates into the total itself (a small tensor's call: no second */    \
        /* clearing and merging of the bins) */                                                 \
        ext_t ext_own, *ext = nt > 1 ? &ext_own : total; /* the header and the bins in use */   \
        if (want_ext && ext != total)                                                           \
            memset(ext, 0, offsetof(ext_t, hist) + 16 * (size_t)(p->nbins + 2));                \
        _Pragma("omp for schedule(static)")                                                     \
        for (int64_t sbk = 0; sbk < n_sb; sbk++) {                                              \
            uint32_t dwords[MAX_SAMPLES][4]; /* group g, draw d: dwords[(g - g0) n_free + d] */ \
            uint32_t rb[BLK], swords[4][PHILOX_LANES];                                          \
            const FT *rows[MAX_SAMPLES];                                                        \
            const int64_t g0 = sbk * sbg, g1 = g0 + sbg < groups ? g0 + sbg : groups;           \
            if (mode == MODE_RANDOM) {                                                          \
                for (int64_t g = g0; g < g1; g++)                                               \
                    for (int d = 0; d < n_free; d++) {                                          \
                        uint32_t *dw = dwords[(g - g0) * n_free + d];                           \
                        dw[0] = (uint32_t)g;                                                    \
                        dw[1] = (uint32_t)d;                                                    \
                        dw[2] = (uint32_t)((uint64_t)g >> 32);                                  \
                        dw[3] = 0;                                                              \
                        philox(p->seed, dw);                                                    \
                    }                                                                           \
            }                                                                                   \
            /* groups whose every sample row took the short path: finite samples */             \
            unsigned char normal[SB];                                                           \
            uint8_t ufb[SB * BLK]; /* underflow flags of the superblock's elements */           \
            const int flag_uf = want_ext && mode != MODE_NONE;                                  \
            if (flag_uf) memset(ufb, 0, (size_t)((g1 - g0) * BLK));                             \
            for (int64_t g = g0; g < g1; g++) normal[g - g0] = mode != MODE_NONE;               \
            if (mode != MODE_NONE)                                                              \
                for (int64_t i = 0; i < n; i++) {                                               \
                    bcur_t cur = bin ? binary_cursor(bin, g0 * BLK) : (bcur_t){0, 0, 0};       \
                    for (int64_t g = g0; g < g1; g++) {                                         \
                        int64_t e0 = g * BLK, cnt = e0 + BLK < numel ? BLK : numel - e0;        \
                        sample_bits(p, mode, g, cnt, i, draws, flips,                           \
                                    dwords + (g - g0) * n_free, swords, rb);                    \
                        const FT *src = x + i * xs + e0;                                        \
                        FT tmp[BLK]; /* the primitive's values, rounded from L1 */              \
                        if (bin) { BINARY(bin, i, cnt, tmp, &cur); src = tmp; }                 \
                        normal[g - g0] &= ROW(src, out + i * numel + e0, cnt, r,                \
                                              mode, rb, flag_uf ? ufb + (g - g0) * BLK : NULL); \
                    }                                                                           \
                }                                                                               \
            for (int64_t g = g0; g < g1; g++) {                                                 \
                int64_t e0 = g * BLK, cnt = e0 + BLK < numel ? BLK : numel - e0;                \
                for (int64_t i = 0; i < n; i++)                                                 \
                    rows[i] = mode != MODE_NONE ? out + i * numel + e0 : x + i * xs + e0;       \
                acc.normed = 0;                                                                 \
                if (want_stats)                                                                 \
                    DIGITS(rows, n, cnt, p, K, dig ? dig + e0 : NULL, zm ? zm + e0 : NULL, &acc, \
                           s_sum, s_min, s_max, s_zero, s_nf, normal[g - g0]);                  \
                if (want_ext)                                                                   \
                    EXTRAS(rows, n, cnt, p, flag_uf && !normal[g - g0] ? ufb + (g - g0) * BLK   \
                           : NULL, g % qstride == 0, acc.normed, ext);                          \
                if (fuse) { /* the consumer GEMM's surrogate, on the rows just rounded */       \
                    FT mean[BLK];                                                               \
                    int close[BLK];                                                             \
                    int64_t c, moving;                                                          \
                    CLOSE(out, numel, n, e0, cnt, eta, mean, close, &c, &moving);               \
                    *n_close += c;                                                              \
                    if (moving)                                                                 \
                        PERTURB_GROUP(out, numel, out, n, numel, g, e0, cnt, eta, fused->seed,  \
                                      close, moving, &fused->grid);                             \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        if (want_stats) acc8_finish(&acc, p, (float)p->vcap, (float)p->vzero, s_sum, s_min,     \
                                    s_max, s_zero, s_nf);                                       \
        if (want_ext) {                                                                         \
            ext->msq += acc.nmsq;                                                               \
            ext->vsq += acc.nvsq;                                                               \
            ext->run += acc.nrun;                                                               \
            if (ext != total) {                                                                 \
                _Pragma("omp critical")                                                         \
                {                                                                               \
                    total->msq += ext->msq; total->vsq += ext->vsq; total->under += ext->under; \
                    total->run += ext->run;                                                     \
                    total->sampled += ext->sampled;                                             \
                    for (int64_t b = 0; b < 4 * (p->nbins + 2); b++)                            \
                        total->hist[b] += ext->hist[b];                                         \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        }                                                                                       \
    }

#define DEFINE_ROUND_STATS_MODE(NAME, FT, ROW, DIGITS, EXTRAS, CLOSE, PERTURB_GROUP, BINARY, MODE) \
    DEFINE_RS_REGION(NAME, FT, ROW, DIGITS, EXTRAS, CLOSE, PERTURB_GROUP, BINARY, MODE)          \
    static void NAME(const FT *x, int64_t xs, FT *out, int64_t n, int64_t numel,                \
                     const params_t *p, double *stats, FT *dig, fused_t *fused,                 \
                     const binop_t *bin) {                                                      \
        const int mode = MODE;                                                                  \
        int draws[MAX_SAMPLES], flips[MAX_SAMPLES];                                             \
        int n_free = sample_draws(n, draws, flips);                                             \
        int64_t groups = (numel + BLK - 1) / BLK;                                               \
        const rp_t r = {p->man_bits, p->k, p->max_bits, p->min_sub_bits, p->finite_only,       \
                        p->saturate};                                                           \
        const double K = log10(sqrt((double)n) / p->t);                                         \
        double s_sum = 0, s_min = INFINITY, s_max = -INFINITY, s_zero = 0, s_nf = 0;            \
        uint8_t *zm = (uint8_t *)(uintptr_t)p->zmask;                                          \
        int want_stats = stats != NULL || dig != NULL || zm != NULL;                            \
        const int want_ext = stats != NULL;                                                     \
        ext_t total;                                                                            \
        if (want_ext) memset(&total, 0, offsetof(ext_t, hist) + 16 * (size_t)(p->nbins + 2));   \
        /* the quantiles sample every qstride-th group: all of them up to QGROUPS groups */     \
        const int64_t qstride = groups > QGROUPS ? (groups + QGROUPS - 1) / QGROUPS : 1;        \
        const int fuse = fused != NULL && mode != MODE_NONE;                                   \
        const FT eta = fuse ? (FT)fused->eta : (FT)0;                                           \
        int64_t n_close = 0;                                                                    \
        int nt = (int)p->nthreads;                                                              \
        if (numel * n < 32768) nt = 1;                                                          \
        /* superblocks of sbg groups; stochastic mode's words serve 4 samples of one group */   \
        const int64_t sbg = mode == MODE_STOCHASTIC || n > SB_MAX_N ? 1 : SB;                   \
        const int64_t n_sb = (groups + sbg - 1) / sbg;                                          \
        const rs_call_t a = {x, out, dig, xs, n, numel, groups, qstride, sbg, n_sb, p, fused,    \
                             draws, flips, n_free, want_stats, want_ext, fuse, nt, r, K,         \
                             fuse ? fused->eta : 0.0, zm, &total, bin};                          \
        if (nt > 1) {                                                                           \
            _Pragma("omp parallel num_threads(nt) reduction(+:s_sum, s_zero, s_nf) reduction(min:s_min) reduction(max:s_max) reduction(+:n_close)") \
            NAME##_region(&a, &s_sum, &s_min, &s_max, &s_zero, &s_nf, &n_close);              \
        } else {                                                                                \
            NAME##_region(&a, &s_sum, &s_min, &s_max, &s_zero, &s_nf, &n_close);              \
        }                                                                                       \
        if (fuse) fused->count = n_close;                                                       \
        if (stats) {                                                                            \
            stats[0] = s_sum;                                                                   \
            stats[1] = s_min;                                                                   \
            stats[2] = s_max;                                                                   \
            stats[3] = s_zero;                                                                  \
            stats[4] = s_nf;                                                                    \
            stats[5] = (double)numel;                                                           \
            stats[6] = total.msq;                                                               \
            stats[7] = total.vsq;                                                               \
            stats[8] = total.under;                                                             \
            stats[9] = ext_quantile(&total, p, 0.1);                                            \
            stats[10] = ext_quantile(&total, p, 0.5);                                           \
            stats[11] = total.run;                                                              \
        }                                                                                       \
    }

DEFINE_ROUND_STATS_MODE(rs_f32_random, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_RANDOM)
DEFINE_ROUND_STATS_MODE(rs_f32_stochastic, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_STOCHASTIC)
DEFINE_ROUND_STATS_MODE(rs_f32_nearest, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_NEAREST)
DEFINE_ROUND_STATS_MODE(rs_f32_up, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_UP)
DEFINE_ROUND_STATS_MODE(rs_f32_down, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_DOWN)
DEFINE_ROUND_STATS_MODE(rs_f32_zero, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_ZERO)
DEFINE_ROUND_STATS_MODE(rs_f32_none, float, round_row_f32, digits_block_f32, extras_block_f32, close_block_f32,
                        perturb_group_f32, binary_block_f32, MODE_NONE)

DEFINE_ROUND_STATS_MODE(rs_f64_random, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_RANDOM)
DEFINE_ROUND_STATS_MODE(rs_f64_stochastic, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_STOCHASTIC)
DEFINE_ROUND_STATS_MODE(rs_f64_nearest, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_NEAREST)
DEFINE_ROUND_STATS_MODE(rs_f64_up, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_UP)
DEFINE_ROUND_STATS_MODE(rs_f64_down, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_DOWN)
DEFINE_ROUND_STATS_MODE(rs_f64_zero, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_ZERO)
DEFINE_ROUND_STATS_MODE(rs_f64_none, double, round_row_f64, digits_block_f64, extras_block_f64, close_block_f64,
                        perturb_group_f64, binary_block_f64, MODE_NONE)

/* The per-call constants of the statistics, once per call instead of once per group. */
static params_t derive_params(const params_t *p, int64_t n) {
    params_t q = *p;
    q.kd = log10(sqrt((double)n) / p->t) + 0.5 * log10((double)(n > 1 ? n - 1 : 1));
    q.vcap = pow(10.0, 2.0 * (q.kd - p->cap));
    q.vzero = pow(10.0, 2.0 * q.kd);
    q.vthr = pow(10.0, 2.0 * (q.kd - p->zero_threshold));
    q.k0 = log10(sqrt((double)n) / p->t);
    q.rv_cap = pow(10.0, 2.0 * (q.k0 - p->cap));
    q.rv_zero = pow(10.0, 2.0 * q.k0);
    uint64_t bc, bz;
    memcpy(&bc, &q.rv_cap, sizeof bc);
    memcpy(&bz, &q.rv_zero, sizeof bz);
    q.b_cap = (int64_t)(bc >> 48);
    q.nbins = (int64_t)(bz >> 48) - q.b_cap + 1;
    if (q.nbins > HBINS) q.nbins = HBINS; /* cap <= 15.95 digits: at most 1712 bins */
    q.rkd = p->run_shift + 0.5 * log10((double)(n > 1 ? n - 1 : 1));
    q.rvcap = pow(10.0, 2.0 * (q.rkd - p->cap));
    q.rvzero = pow(10.0, 2.0 * q.rkd);
    return q;
}

/* Exported entry points: one specialised body per mode (the mode is a constant in each). */
#define DEFINE_ROUND_STATS(NAME, FT, DT)                                                        \
    void NAME(const FT *x, int64_t xs, FT *out, int64_t n, int64_t numel, const params_t *p,   \
              double *stats, FT *dig, fused_t *fused) {                                         \
        if (n < 1 || n > MAX_SAMPLES) return;                                                   \
        params_t q = derive_params(p, n);                                                       \
        p = &q;                                                                                 \
        switch (p->mode) {                                                                      \
        case MODE_RANDOM: rs_##DT##_random(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;         \
        case MODE_STOCHASTIC: rs_##DT##_stochastic(x, xs, out, n, numel, p, stats, dig, fused, NULL); break; \
        case MODE_NEAREST: rs_##DT##_nearest(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;       \
        case MODE_UP: rs_##DT##_up(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;                 \
        case MODE_DOWN: rs_##DT##_down(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;             \
        case MODE_ZERO: rs_##DT##_zero(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;             \
        default: rs_##DT##_none(x, xs, out, n, numel, p, stats, dig, fused, NULL); break;                    \
        }                                                                                       \
    }

DEFINE_ROUND_STATS(fxstab_round_stats_f32, float, f32)
DEFINE_ROUND_STATS(fxstab_round_stats_f64, double, f64)

/* One call of fxstab.cpu.bindings.Prepared: its arguments in one struct (a ctypes call converts each
 * argument it is given: 9 of them cost more than the kernel on a small tensor), the derived
 * constants computed once when it was prepared (fxstab_prepare_params). */
typedef struct {
    const void *x;
    int64_t xs;
    void *out;
    int64_t n, numel, f64;
    params_t *p; /* derived: its seed and nthreads set per call */
    double *stats;
    fused_t *fused; /* the consumer GEMM's surrogate (its seed set per call), or NULL */
    const binop_t *bin; /* the primitive whose values are rounded (x unused), or NULL */
    void *dig;          /* per-element digits out, or NULL */
} prepared_t;

void fxstab_prepare_params(params_t *p, int64_t n) { *p = derive_params(p, n); }

void fxstab_round_stats_prepared(const prepared_t *c) {
    const params_t *p = c->p;
    if (c->n < 1 || c->n > MAX_SAMPLES || (c->bin && p->mode == MODE_NONE)) return;
#define PREPARED_CALL(DT, FT)                                                                     \
    do {                                                                                          \
        const FT *x = (const FT *)c->x;                                                           \
        FT *out = (FT *)c->out;                                                                   \
        switch (p->mode) {                                                                        \
        case MODE_RANDOM: rs_##DT##_random(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        case MODE_STOCHASTIC: rs_##DT##_stochastic(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        case MODE_NEAREST: rs_##DT##_nearest(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        case MODE_UP: rs_##DT##_up(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        case MODE_DOWN: rs_##DT##_down(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        case MODE_ZERO: rs_##DT##_zero(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        default: rs_##DT##_none(x, c->xs, out, c->n, c->numel, p, c->stats, (FT *)c->dig, c->fused, c->bin); break; \
        }                                                                                         \
    } while (0)
    if (c->f64)
        PREPARED_CALL(f64, double);
    else
        PREPARED_CALL(f32, float);
#undef PREPARED_CALL
}


/* The closeness test of group g (its close elements counted), then THEN: the read-only scan
 * adds whether any element would move, the perturbation pass perturbs them. */
#define PERTURB_CLOSE_GROUP(CLOSE, FT, THEN)                                                    \
    {                                                                                           \
        FT mean[BLK];                                                                           \
        int close[BLK];                                                                         \
        int64_t e0 = g * BLK, cnt = e0 + BLK < numel ? BLK : numel - e0, c, mv;                 \
        CLOSE(x, xs, n, e0, cnt, eta, mean, close, &c, &mv);                                    \
        count += c;                                                                             \
        THEN;                                                                                   \
    }

/* Stacked samples whose elements are all separated (or exact zeros) are common: the rounded
 * output of the previous operator. A read-only scan finds them first, and then nothing is
 * written (*moved = 0: the caller keeps the input). The scan stops at the first group that
 * moves, with a team too: each thread skips its remaining groups once any has found one (a
 * full parallel scan was a second closeness pass over every group that moves, a third of the
 * surrogate's time). */
#define DEFINE_PERTURB(NAME, FT, CLOSE, PERTURB_GROUP)                                          \
    int64_t NAME(const FT *x, int64_t xs, FT *out, int64_t n, int64_t numel, double eta_d,     \
                 uint64_t seed, const grid_t *grid, int64_t nthreads, int64_t *moved) {         \
        if (n < 1 || n > MAX_SAMPLES) return -1;                                                \
        int64_t groups = (numel + BLK - 1) / BLK, count = 0, moving = 0;                        \
        int nt = (int)nthreads;                                                                 \
        const FT eta = (FT)eta_d;                                                               \
        if (numel * n < 32768) nt = 1;                                                          \
        if (xs != 0) {                                                                          \
            if (nt == 1) /* one thread: the scan stops at the first group that moves */         \
                for (int64_t g = 0; g < groups && !moving; g++)                                 \
                    PERTURB_CLOSE_GROUP(CLOSE, FT, moving += mv)                                \
            else {                                                                              \
                int found = 0;                                                                  \
                _Pragma("omp parallel for num_threads(nt) schedule(static) reduction(+:count)") \
                for (int64_t g = 0; g < groups; g++) {                                          \
                    if (__atomic_load_n(&found, __ATOMIC_RELAXED)) continue;                    \
                    PERTURB_CLOSE_GROUP(CLOSE, FT,                                              \
                                        if (mv) __atomic_store_n(&found, 1, __ATOMIC_RELAXED))  \
                }                                                                               \
                moving = found;                                                                 \
            }                                                                                   \
            if (moving == 0) {                                                                  \
                *moved = 0;                                                                     \
                return count;                                                                   \
            }                                                                                   \
            count = 0;                                                                          \
        }                                                                                       \
        *moved = 1;                                                                             \
        if (nt > 1) {                                                                           \
            _Pragma("omp parallel for num_threads(nt) schedule(static) reduction(+:count)")     \
            for (int64_t g = 0; g < groups; g++)                                                \
                PERTURB_CLOSE_GROUP(CLOSE, FT, PERTURB_GROUP(x, xs, out, n, numel, g, e0, cnt, eta, \
                                                      seed, close, mv, grid))                         \
        } else { /* one thread: no OpenMP region (~1 us: round_stats) */                        \
            for (int64_t g = 0; g < groups; g++)                                                \
                PERTURB_CLOSE_GROUP(CLOSE, FT, PERTURB_GROUP(x, xs, out, n, numel, g, e0, cnt, eta, \
                                                      seed, close, mv, grid))                         \
        }                                                                                       \
        return count;                                                                           \
    }

DEFINE_PERTURB(fxstab_perturb_f32, float, close_block_f32, perturb_group_f32)
DEFINE_PERTURB(fxstab_perturb_f64, double, close_block_f64, perturb_group_f64)


/* ---------------------------------------------------------------------------------------
 * A unary function of fp32 values that are all bf16 values (low 16 bits zero: the rounded
 * output of a primitive in the bf16 format) is one of 65536 results: out[e] = table[bits(x[e])
 * >> 16], where the caller computed the table with the function itself (torch's op on every
 * bf16 value), so the result is bit for bit the function's. Returns 1, or 0 as soon as a value
 * is not a bf16 value (then out is incomplete and the caller computes the function itself).
 */
static inline int64_t lookup_chunk(const uint32_t *xb, float *out, int64_t numel,
                                   const float *table, int64_t c) {
    int64_t e0 = c * 4096, e1 = e0 + 4096 < numel ? e0 + 4096 : numel;
    uint32_t low = 0;
    for (int64_t e = e0; e < e1; e++) {
        uint32_t b = xb[e];
        low |= b;
        out[e] = table[b >> 16];
    }
    return (low & 0xFFFFu) != 0;
}

int64_t fxstab_lookup_bf16(const float *x, float *out, int64_t numel, const float *table,
                           int64_t nthreads) {
    const uint32_t *xb = (const uint32_t *)x;
    int64_t chunks = (numel + 4095) / 4096, bad = 0;
    int nt = numel < 32768 ? 1 : (int)nthreads;
    if (nt > 1) {
        _Pragma("omp parallel for num_threads(nt) schedule(static) reduction(|:bad)")
        for (int64_t c = 0; c < chunks; c++) bad |= lookup_chunk(xb, out, numel, table, c);
    } else { /* one thread: no OpenMP region (~1 us: round_stats) */
        for (int64_t c = 0; c < chunks; c++) bad |= lookup_chunk(xb, out, numel, table, c);
    }
    return !bad;
}

/* ---------------------------------------------------------------------------------------
 * fxstab.numerics.randbits.derive_seed (SplitMix64 finalisation of the seed mixed with a salt) for a
 * call's primitives at once: seeds[i] = derive_seed(seed, salts[i]) and then[i] =
 * derive_seed(seeds[i], then_salt). In Python each is a dozen big-integer operations.
 */

/* derive_seed(bases[i], call, purposes[i]) for every i: the seeds of one analysed call's steps
 * (fxstab.rules.op_level.SampleTracer), in one call instead of one Python loop each. */
void fxstab_call_seeds(const uint64_t *bases, const uint64_t *purposes, int64_t n,
                       uint64_t call, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = derive1(derive1(bases[i], call), purposes[i]);
}

void fxstab_derive_seeds(uint64_t seed, const uint64_t *salts, int64_t n, uint64_t then_salt,
                         uint64_t *seeds, uint64_t *then) {
    for (int64_t i = 0; i < n; i++) {
        seeds[i] = derive1(seed, salts[i]);
        then[i] = derive1(seeds[i], then_salt);
    }
}

/* ---------------------------------------------------------------------------------------
 * The bf16 GEMM path's conversions (fxstab.numerics.lowp_gemm, CPU): bit for bit the torch
 * expressions of its reference (split_reference, join_reference), one pass each instead of four
 * or five (a conversion, a subtraction, nan_to_num, a test, another conversion; widen, add).
 */
static inline uint16_t f32_to_bf16(float f) { /* torch's float -> bfloat16: nearest, even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float nan_to_zero(float v) { /* torch's nan_to_num(v, nan=0.0) */
    if (v != v) return 0.0f;
    if (isinf(v)) return v > 0 ? 3.40282347e38f : -3.40282347e38f;
    return v;
}

/* hi = bf16(x), lo = bf16(nan_to_num(x - hi, nan=0)); returns whether any x - hi is nonzero */
int64_t fxstab_split_bf16(const float *x, uint16_t *hi, uint16_t *lo, int64_t numel,
                          int64_t nthreads) {
    int64_t any = 0;
    int nt = numel < 32768 ? 1 : (int)nthreads;
    _Pragma("omp parallel for num_threads(nt) schedule(static) reduction(|:any) if(nt > 1)")
    for (int64_t e = 0; e < numel; e++) {
        float v = x[e];
        uint16_t h = f32_to_bf16(v);
        float d = nan_to_zero(v - bf16_to_f32(h));
        hi[e] = h;
        lo[e] = f32_to_bf16(d);
        any |= d != 0.0f;
    }
    return any;
}

/* out = float(hi) + nan_to_num(float(r), nan=0) (+ float(dp) where dp is given), in that order */
void fxstab_join_bf16(const uint16_t *hi, const uint16_t *r, const uint16_t *dp, float *out,
                      int64_t numel, int64_t nthreads) {
    int nt = numel < 32768 ? 1 : (int)nthreads;
    if (dp) {
        _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")
        for (int64_t e = 0; e < numel; e++)
            out[e] = (bf16_to_f32(hi[e]) + nan_to_zero(bf16_to_f32(r[e]))) + bf16_to_f32(dp[e]);
    } else {
        _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")
        for (int64_t e = 0; e < numel; e++)
            out[e] = bf16_to_f32(hi[e]) + nan_to_zero(bf16_to_f32(r[e]));
    }
}
