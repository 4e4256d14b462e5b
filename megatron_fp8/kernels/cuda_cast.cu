// One 128x128 tile of x [M, K] (BF16, M and K multiples of 128) per block of 256 threads: the
// rowwise FP8 copy [M, K] and the columnwise copy (segment e's [K, m_e] at K * start_e), with the
// package's scale layouts (megatron_fp8/quant/triton_cast.py, _cast_tile_kernel):
//   MODE 0 (1x128): row scales [K/128, m_e] at start_e * K/128, column scales [M/128, K];
//   MODE 1 (128x128): one scale per tile, [M/128, K/128], and again transposed per segment
//     ([K/128, m_e/128] at start_e/128 * K/128) for the columnwise copy;
//   MODE 2 (tensor): the segment's scale read from tscale[e * 4], no scale written.
// The tile goes through shared memory once: phase A loads it (16-byte vectors, all issued before
// any use), casts the rowwise copy from registers and parks the BF16 tile in shared memory;
// phase B reads each column of it, takes the column amax, casts, and writes the FP8 tile
// transposed into shared memory (over the BF16 tile); phase C stores those rows 128 bytes a warp.
// Compile with -DMODE=0|1|2, -DE5M2=0|1 and -DMINB=<blocks an SM> (__launch_bounds__), and three
// switches, off here by default: -DKFAST=1, the grid is K/128 x M/128 (neighbouring blocks read
// neighbouring 256-byte pieces of the same rows, instead of the same columns of neighbouring row
// tiles); -DSTREAM=1, the FP8 copies are stored with the evict-first hint (st.global.cs);
// -DNOCLAMP=1, no clamp before the conversion, whose .satfinite already maps anything finite past
// the format's largest value to it (~20% fewer instructions). Block amaxes are over finite values,
// and NaN / +-inf inputs get the reference's bytes (pack4), as RECIPES.md's non-finite rules say. Measured on an
// H200 (scripts/probe_cuda_cast.py, docs/benchmarks.md run W): all three together took the 1x128
// cast of x 16384x4096 from 88 to 78 us, the 128x128 and tensor casts of the experts' weights
// from 81 to 74 and 79 to 73 us; quant/cuda_cast.py builds with KFAST=1 STREAM=1 and NOCLAMP=1
// (NOCLAMP=0 under MEGATRON_FP8_CAST_CLAMP=1).
#ifndef MODE
#define MODE 0
#endif
#ifndef E5M2
#define E5M2 0
#endif
#if E5M2
#define FMAX 57344.0f
#define F_EXP 15
#define F_MANT 0x600000
#else
#define FMAX 448.0f
#define F_EXP 8
#define F_MANT 0x600000
#endif
#ifndef MINB
#define MINB 4  // blocks an SM: 4 caps the registers at 64
#endif
#ifndef KFAST
#define KFAST 0
#endif
#ifndef STREAM
#define STREAM 0
#endif
#ifndef NOCLAMP
#define NOCLAMP 0
#endif
#ifndef GATHER
#define GATHER 0
#endif
#if STREAM
#define STORE(ptr, val) __stcs(ptr, val)
#else
#define STORE(ptr, val) (*(ptr) = (val))
#endif
#define T 128
#define XS 136  // BF16 elements per shared row: 272 bytes, 16-byte aligned
#define OS 33   // 32-bit words per transposed FP8 row: 128 bytes + 4, conflict-free stores

__device__ __forceinline__ void pow2_scale(float amax, float &s, float &inv) {
  // The largest power of two <= FMAX / amax, from exponent bits; (1, 1) for 0, inf or NaN.
  int bits = __float_as_int(amax);
  int ex = ((bits >> 23) & 0xFF) - 127;
  int mant = bits & 0x7FFFFF;
  int e = F_EXP - ex - (mant <= F_MANT ? 0 : 1);
  e = max(min(e, 127), -126);
  s = __int_as_float((e + 127) << 23);
  inv = __int_as_float(e == 127 ? (1 << 22) : ((127 - e) << 23));
  if (!(amax > 0.0f && amax < __int_as_float(0x7F800000))) {
    s = 1.0f;
    inv = 1.0f;
  }
}

__device__ __forceinline__ float clampq(float v) {  // NaN passes through, as the package's clamp
#if NOCLAMP  // left to cvt's .satfinite (+-inf and overflow to +-MAX_NORM, NaN kept): 3 instructions less a value
  return v;
#else
  return v > FMAX ? FMAX : (v < -FMAX ? -FMAX : v);
#endif
}

__device__ __forceinline__ unsigned short cvt2(float lo, float hi) {
  unsigned short d;
#if E5M2
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(clampq(hi)), "f"(clampq(lo)));
#else
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(clampq(hi)), "f"(clampq(lo)));
#endif
  return d;
}


__device__ __forceinline__ float lo_f(unsigned w) { return __int_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w) { return __int_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ bool finite(float v) { return (__float_as_int(v) & 0x7F800000) != 0x7F800000; }

__device__ __forceinline__ float absfin(float v) {  // |v| for a block amax: finite values only
  return finite(v) ? fabsf(v) : 0.0f;
}

// Two BF16 words (four values, w0's low half the lowest byte) times s in FP8. cvt's .satfinite
// would turn +-inf into +-MAX_NORM: a NaN or +-inf input gets reference.nonfinite_bits' byte
// instead, found on the BF16 bits with per-half SIMD compares (no branch, no float kept alive: a
// per-value branch made the block modes spill registers).
__device__ __forceinline__ unsigned pack4(unsigned w0, unsigned w1, float s) {
  const unsigned q = (unsigned)cvt2(lo_f(w0) * s, hi_f(w0) * s) | ((unsigned)cvt2(lo_f(w1) * s, hi_f(w1) * s) << 16);
  // per 16-bit half: 0xFFFF where the exponent is all ones (NaN, +-inf); then one byte a value
  const unsigned nf = __byte_perm(__vcmpeq2(w0 & 0x7F807F80u, 0x7F807F80u),
                                  __vcmpeq2(w1 & 0x7F807F80u, 0x7F807F80u), 0x6420);
#if E5M2
  const unsigned inf = __byte_perm(__vcmpeq2(w0 & 0x7FFF7FFFu, 0x7F807F80u),
                                   __vcmpeq2(w1 & 0x7FFF7FFFu, 0x7F807F80u), 0x6420);
  const unsigned sign = __byte_perm(w0, w1, 0x7531) & 0x80808080u;  // each value's sign bit, in its byte
  const unsigned fix = ((nf & ~inf) & 0x7F7F7F7Fu) | (inf & (0x7C7C7C7Cu | sign));  // NaN 0x7F; +-inf 0x7C / 0xFC
#else
  const unsigned fix = nf & 0x7F7F7F7Fu;  // E4M3 has no inf: NaN 0x7F
#endif
  return (q & ~nf) | fix;
}

struct Where {  // a tile's rows and the segment (expert) holding them
  long long m0, k0, start, length;
  int eid;
};

__device__ __forceinline__ Where locate(long long m0, long long k0, const long long *__restrict__ seg, int n_seg,
                                        int M) {
  Where w{m0, k0, 0, M, 0};
  if (n_seg > 0) {  // the last of equal offsets: empty segments are skipped
    for (int j = 1; j < n_seg; ++j) w.eid += (seg[j] <= m0);
    w.start = seg[w.eid];
    w.length = seg[w.eid + 1] - w.start;
  }
  return w;
}

// One tile a block (grid: M/128 x K/128, or K/128 x M/128 with KFAST); seg: the segments'
// offsets, n_seg 0: one tensor. With -DGATHER=1 the segments are experts zero-padded to 128 rows
// and x holds only their real rows, back to back (src: the real segments' offsets): a tile row
// past its expert's real count reads as zeros, so the copies are those of the padded tensor
// without it ever being written.
extern "C" __global__ void __launch_bounds__(256, MINB)
cast_tile(const unsigned short *__restrict__ x, unsigned char *__restrict__ row, float *__restrict__ row_s,
          unsigned char *__restrict__ col, float *__restrict__ col_s, const long long *__restrict__ seg,
          const float *__restrict__ tscale, const long long *__restrict__ src, int M, int K, int n_seg) {
  __shared__ __align__(16) unsigned short xs[T * XS];
#if MODE == 0
  __shared__ float part[2 * T];  // the column amaxes of the two row halves
#elif MODE == 1
  __shared__ float red[8];  // the warps' amaxes
#endif
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int v = t & 15, r0 = t >> 4;  // 16 threads a row, 8 BF16 each: rows r0 + 16 i
#if KFAST
  const long long m0 = (long long)blockIdx.y * T, k0 = (long long)blockIdx.x * T;
  [[maybe_unused]] const int bm = blockIdx.y, bk = blockIdx.x;  // scale indices (modes 0, 1)
#else
  const long long m0 = (long long)blockIdx.x * T, k0 = (long long)blockIdx.y * T;
  [[maybe_unused]] const int bm = blockIdx.x, bk = blockIdx.y;  // scale indices (modes 0, 1)
#endif
  uint4 d[8];  // every load issued before anything waits on one
#if GATHER
  const Where w = locate(m0, k0, seg, n_seg, M);
  const long long from = src[w.eid], real = src[w.eid + 1] - from, first = m0 - w.start;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const long long r = first + r0 + 16 * i;  // the row within its expert
    d[i] = r < real ? *reinterpret_cast<const uint4 *>(x + (from + r) * K + k0 + 8 * v) : make_uint4(0, 0, 0, 0);
  }
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) d[i] = *reinterpret_cast<const uint4 *>(x + (m0 + r0 + 16 * i) * K + k0 + 8 * v);
  const Where w = locate(m0, k0, seg, n_seg, M);
#endif
  float tile_s = 1.0f;
#if MODE == 1
  float tmax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const unsigned u[4] = {d[i].x, d[i].y, d[i].z, d[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) tmax = fmaxf(tmax, fmaxf(absfin(lo_f(u[j])), absfin(hi_f(u[j]))));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
  if (lane == 0) red[warp] = tmax;
  __syncthreads();
  tmax = red[0];
#pragma unroll
  for (int j = 1; j < 8; ++j) tmax = fmaxf(tmax, red[j]);
  float tile_inv;
  pow2_scale(tmax, tile_s, tile_inv);
  if (t == 0) {
    row_s[bm * (K / T) + bk] = tile_inv;
    // and transposed per segment, [K/128, m_e/128] at start_e/128 * K/128 (for one tensor: row_s^T)
    col_s[w.start / T * (K / T) + bk * (w.length / T) + (w.m0 - w.start) / T] = tile_inv;
  }
#elif MODE == 2
  tile_s = tscale[w.eid * 4];
#endif
  // ---- phase A: the rowwise copy ----
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 16 * i;
    const unsigned u[4] = {d[i].x, d[i].y, d[i].z, d[i].w};
    float s = tile_s;
#if MODE == 0
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) a = fmaxf(a, fmaxf(absfin(lo_f(u[j])), absfin(hi_f(u[j]))));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float inv;
    pow2_scale(a, s, inv);
    if (v == 0) row_s[w.start * (K / T) + bk * w.length + (w.m0 + r - w.start)] = inv;
#endif
    uint2 q;
    q.x = pack4(u[0], u[1], s);
    q.y = pack4(u[2], u[3], s);
    STORE(reinterpret_cast<uint2 *>(row + (w.m0 + r) * K + w.k0 + 8 * v), q);
    *reinterpret_cast<uint4 *>(xs + r * XS + 8 * v) = d[i];
  }
  __syncthreads();

  // ---- phase B: columns (thread: column c, rows 64 h .. 64 h + 63) ----
  const int c = t & 127, h = t >> 7;
  const unsigned short *xc = xs + 64 * h * XS + c;
  unsigned p[32];  // the column's 64 BF16 values, two a word
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    p[i] = xc[2 * i * XS] | ((unsigned)xc[(2 * i + 1) * XS] << 16);
    a = fmaxf(a, fmaxf(absfin(lo_f(p[i])), absfin(hi_f(p[i]))));
  }
  float s = tile_s;
#if MODE == 0
  part[h * T + c] = a;
#endif
  __syncthreads();  // the column amaxes shared, every read of the BF16 tile done
#if MODE == 0
  float inv;
  pow2_scale(fmaxf(part[c], part[T + c]), s, inv);
  if (h == 0) col_s[bm * (long long)K + w.k0 + c] = inv;
#endif
  unsigned *os = reinterpret_cast<unsigned *>(xs);  // the FP8 tile, transposed, over the BF16 one
#pragma unroll
  for (int j = 0; j < 16; ++j)  // rows 4 j .. 4 j + 3 of the column: one word
    os[c * OS + 16 * h + j] = pack4(p[2 * j], p[2 * j + 1], s);
  __syncthreads();

  // ---- phase C: the transposed FP8 tile out, one 128-byte row a warp step ----
  unsigned char *dst = col + w.start * K + (w.m0 - w.start);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int kk = warp * 16 + j;
    STORE(reinterpret_cast<unsigned *>(dst + (w.k0 + kk) * w.length + 4 * lane), os[kk * OS + lane]);
  }
}
