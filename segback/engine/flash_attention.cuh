// Flash attention (forward, dK/dV, dQ) for segback, compiled by MLX's cuda_kernel (NVRTC).
//
// Tensor-core mma.sync m16n8k16 (bf16 or fp16 in, fp32 accumulate), online softmax, the row
// log-sum-exp saved by the forward; the backward recomputes probabilities block by block from
// it, so nothing [L, L] ever exists. The dQ pass is separate from the dK/dV pass (no atomics:
// deterministic). Masks are described, never materialized: causal, a sliding window of W keys
// (query i sees keys j with i + off - W < j <= i + off), and packed examples (`seg` ids: a
// query sees keys of its own example). Block ranges (`kr`, `qr`) are computed on the host and
// only skip blocks that are wholly masked; every element is masked exactly. The kernels clamp
// them into [0, Lk] / [0, Lq] too: a start is rounded down to a block, and a negative one would
// load rows before 0 (an illegal access with Lq < Lk and a window when the host gave one).
//
// prm (int32): B, H, Hkv, Lq, Lk, off, W (0 = no window).
// Layouts: q, o, do [B, H, Lq, D]; k, v [B, Hkv, Lk, D]; lse, delta [B, H, Lq] float32.

namespace sbflash {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T>
__device__ __forceinline__ uint32_t pack_f2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack_f2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack_f2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ uint32_t ld32(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Two 16-bit elements from different rows into one register (lo = a).
template <typename T>
__device__ __forceinline__ uint32_t ld16x2(const T* a, const T* b) {
  uint32_t lo = *reinterpret_cast<const unsigned short*>(a);
  uint32_t hi = *reinterpret_cast<const unsigned short*>(b);
  return lo | (hi << 16);
}

// The B fragment (k16 x n8, two registers) of a row-major [k][n] shared tile with row stride S,
// at `p` = &tile[k0][n0]: one ldmatrix.trans (LDSM) or four 16-bit loads.
template <typename T, int S, int LDSM>
__device__ __forceinline__ void b_frag_trans(const T* p, uint32_t& b0, uint32_t& b1) {
  const int lane = threadIdx.x % 32;
  if constexpr (LDSM) {
    uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p + (lane & 15) * S));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b0), "=r"(b1)
                 : "r"(addr));
  } else {
    const int g = lane / 4, t = lane % 4;
    const T* q = p + (2 * t) * S + g;
    b0 = ld16x2(q, q + S);
    b1 = ld16x2(q + 8 * S, q + 9 * S);
  }
}

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// D += A B on one 16 x 8 tile (A 16 x 16 row-major fragments, B 16 x 8 column fragments).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  Mma<T>::run(d, a0, a1, a2, a3, b0, b1);
}

// Rows [r0, r0 + ROWS) of a row-major global array with row stride `ld` elements, COLS columns
// from `src` (already offset to the first column), into shared memory with row stride SS.
// Rows at or past `n` are zero.
template <typename T, int ROWS, int COLS, int SS, int THREADS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int r0, int n, int ld) {
  constexpr int VEC = 8;  // 16 bytes
  constexpr int PER_ROW = COLS / VEC;
  for (int i = threadIdx.x; i < ROWS * PER_ROW; i += THREADS) {
    int r = i / PER_ROW, c = (i % PER_ROW) * VEC;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r0 + r < n) {
      val = *reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * ld + c);
    }
    *reinterpret_cast<uint4*>(dst + r * SS + c) = val;
  }
}

template <int SEG>
__device__ __forceinline__ bool visible(int i, int j, int Lq, int Lk, int off, int W,
                                        const int* seg) {
  if (i >= Lq || j >= Lk) return false;
  int ip = i + off;
  if (j > ip) return false;
  if (W > 0 && j <= ip - W) return false;
  if constexpr (SEG) {
    if (seg[ip] != seg[j]) return false;
  }
  return true;
}

#define SBFLASH_LOG2E 1.4426950408889634f
#define SBFLASH_LN2 0.6931471805599453f

// Max / sum over the 4 lanes that hold one row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The forward's online softmax step for one key tile, rows r0 / r0 + 8 of a warp: (mx0, mx1)
// are the tile's row maxima (base 2, already reduced over the row); rescales the running
// accumulator and sums to the new maxima and turns the scores s into exp2(s - max).
template <int NS, int NC>
__device__ __forceinline__ void online_softmax(float (&s)[NS][4], float (&acc)[NC][4],
                                               float& m0, float& m1, float& l0, float& l1,
                                               float mx0, float mx1) {
  float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  float base0 = mn0 == neg_inf() ? 0.f : mn0, base1 = mn1 == neg_inf() ? 0.f : mn1;
  float c0 = exp2f(m0 - base0), c1 = exp2f(m1 - base1);
  m0 = mn0;
  m1 = mn1;
  l0 *= c0;
  l1 *= c1;
#pragma unroll
  for (int n = 0; n < NC; ++n) {
    acc[n][0] *= c0;
    acc[n][1] *= c0;
    acc[n][2] *= c1;
    acc[n][3] *= c1;
  }
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    s[n][0] = exp2f(s[n][0] - base0);
    s[n][1] = exp2f(s[n][1] - base0);
    s[n][2] = exp2f(s[n][2] - base1);
    s[n][3] = exp2f(s[n][3] - base1);
    l0 += s[n][0] + s[n][1];
    l1 += s[n][2] + s[n][3];
  }
}

// Rows r0 and r1 (= r0 + 8) of a warp's C fragments acc (columns n*8 + 2t of p, row stride
// ld), times s0 / s1, rounded to T into global memory; rows at or past n are left out.
template <typename T, int NC>
__device__ __forceinline__ void store_rows(T* p, int ld, int r0, int r1, int n,
                                           const float (&acc)[NC][4], float s0, float s1) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < NC; ++j) {
    int c = j * 8 + 2 * t;
    if (r0 < n)
      *reinterpret_cast<uint32_t*>(p + (size_t)r0 * ld + c) =
          pack_f2<T>(acc[j][0] * s0, acc[j][1] * s0);
    if (r1 < n)
      *reinterpret_cast<uint32_t*>(p + (size_t)r1 * ld + c) =
          pack_f2<T>(acc[j][2] * s1, acc[j][3] * s1);
  }
}

// The forward's row log-sum-exp (natural log; -inf for a row that sees no key) of rows r0, r1
// from the running max (base 2) and sum, into lse (one (batch, head)'s rows).
__device__ __forceinline__ void store_lse(float* lse, int r0, int r1, int Lq, float m0,
                                          float l0, float m1, float l1) {
  if (r0 < Lq) lse[r0] = l0 > 0.f ? (m0 + log2f(l0)) * SBFLASH_LN2 : neg_inf();
  if (r1 < Lq) lse[r1] = l1 > 0.f ? (m1 + log2f(l1)) * SBFLASH_LN2 : neg_inf();
}

// Phase 1 of a dK/dV block, after S^T and dP^T: P^T = exp2(S^T scale log2(e) - LSE log2(e))
// and dS^T = P^T (dP^T - delta) for keys kg*16.. and NT tiles of 8 queries from (cg*NT)*8,
// rounded to T into sP / sS (row stride SP). sL / sD: the block's LSE and delta; `full`: no
// element of the block is masked.
template <typename T, int SEG, int NT, int SP>
__device__ __forceinline__ void dkdv_probs(const float (&st)[NT][4], const float (&dpt)[NT][4],
                                           T* sP, T* sS, const float* sL, const float* sD,
                                           int q0, int k0, int kg, int cg, float sl2, bool full,
                                           int Lq, int Lk, int off, int W, const int* seg) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float p[4], ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int kl = kg * 16 + g + (e >= 2 ? 8 : 0);
      int ql = (cg * NT + n) * 8 + 2 * t + (e & 1);
      bool vis = full || visible<SEG>(q0 + ql, k0 + kl, Lq, Lk, off, W, seg);
      p[e] = vis ? exp2f(st[n][e] * sl2 - sL[ql] * SBFLASH_LOG2E) : 0.f;
      ds[e] = p[e] * (dpt[n][e] - sD[ql]);
    }
    int kl = kg * 16 + g, ql = (cg * NT + n) * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(sP + kl * SP + ql) = pack_f2<T>(p[0], p[1]);
    *reinterpret_cast<uint32_t*>(sP + (kl + 8) * SP + ql) = pack_f2<T>(p[2], p[3]);
    *reinterpret_cast<uint32_t*>(sS + kl * SP + ql) = pack_f2<T>(ds[0], ds[1]);
    *reinterpret_cast<uint32_t*>(sS + (kl + 8) * SP + ql) = pack_f2<T>(ds[2], ds[3]);
  }
}

// acc += P B for a warp's 16 rows: P the register tile s (16 x NS*8, C-fragment layout,
// rounded to T as the A operand), B the shared tile at pb (NS*8 rows, row stride S, NC*8
// columns).
template <typename T, int NS, int NC, int S, int LDSM>
__device__ __forceinline__ void mma_regs_smem(float (&acc)[NC][4], const float (&s)[NS][4],
                                              const T* pb) {
#pragma unroll
  for (int j = 0; j < NS / 2; ++j) {
    uint32_t a0 = pack_f2<T>(s[2 * j][0], s[2 * j][1]);
    uint32_t a1 = pack_f2<T>(s[2 * j][2], s[2 * j][3]);
    uint32_t a2 = pack_f2<T>(s[2 * j + 1][0], s[2 * j + 1][1]);
    uint32_t a3 = pack_f2<T>(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      uint32_t b0, b1;
      b_frag_trans<T, S, LDSM>(pb + j * 16 * S + n * 8, b0, b1);
      mma<T>(acc[n], a0, a1, a2, a3, b0, b1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: one CTA of 4 warps per 64 query rows of one (batch, head) and one slice of DV output
// columns (blockIdx.z; D = 512 splits V in two so the accumulator fits the registers).
template <typename T, int D, int DV, int BK, int SEG, int LDSM>
__device__ void forward(const T* q, const T* k, const T* v, const float* scale_p, const int* prm,
                        const int* kr, const int* seg, T* o, float* lse) {
  constexpr int BQ = 64, PAD = 8, SQ = D + PAD, SV = DV + PAD, THREADS = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BQ * SQ;
  T* sV = sK + BK * SQ;
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int qb = blockIdx.x, bh = blockIdx.y, zs = blockIdx.z;
  const int b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int q0 = qb * BQ;
  const T* qp = q + (size_t)bh * Lq * D;
  const T* kp = k + (size_t)(b * Hkv + hk) * Lk * D;
  const T* vp = v + (size_t)(b * Hkv + hk) * Lk * D + zs * DV;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float sl2 = scale_p[0] * SBFLASH_LOG2E;
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;

  load_tile<T, BQ, D, SQ, THREADS>(sQ, qp, q0, Lq, D);

  float acc[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;
  const int kstart = max(kr[2 * qb], 0), kend = min(kr[2 * qb + 1], Lk);

  for (int k0 = (kstart / BK) * BK; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tile<T, BK, D, SQ, THREADS>(sK, kp, k0, Lk, D);
    load_tile<T, BK, DV, SV, THREADS>(sV, vp, k0, Lk, D);
    __syncthreads();

    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* qa = sQ + (warp * 16 + g) * SQ + kk * 16 + 2 * t;
      uint32_t a0 = ld32(qa), a1 = ld32(qa + 8 * SQ), a2 = ld32(qa + 8), a3 = ld32(qa + 8 * SQ + 8);
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        const T* kb = sK + (n * 8 + g) * SQ + kk * 16 + 2 * t;
        mma<T>(s[n], a0, a1, a2, a3, ld32(kb), ld32(kb + 8));
      }
    }

    float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int col = k0 + n * 8 + 2 * t + (e & 1);
        int row = e < 2 ? r0 : r1;
        bool vis = visible<SEG>(row, col, Lq, Lk, off, W, segb);
        s[n][e] = vis ? s[n][e] * sl2 : neg_inf();
      }
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    online_softmax<BK / 8, DV / 8>(s, acc, m0, m1, l0, l1, quad_max(mx0), quad_max(mx1));
    mma_regs_smem<T, BK / 8, DV / 8, SV, LDSM>(acc, s, sV);
  }

  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  store_rows<T, DV / 8>(o + (size_t)bh * Lq * D + zs * DV, D, r0, r1, Lq, acc, inv0, inv1);
  if (zs == 0 && t == 0) store_lse(lse + (size_t)bh * Lq, r0, r1, Lq, m0, l0, m1, l1);
}

// ---------------------------------------------------------------------------------------------
// dK, dV: one CTA of 8 warps per BKV keys of one (batch, kv head); it walks every query head of
// the group and every query block that sees these keys. Phase 1 computes P^T and dS^T for a
// [BKV, BQ] block into shared memory; phase 2 accumulates dV += P^T dO and dK += dS^T Q, each
// warp owning 16 keys x CW columns in registers.
template <typename T, int D, int BKV, int BQ, int SEG, int LDSM>
__device__ void backward_dkdv(const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                              const float* delta, const float* scale_p, const int* prm,
                              const int* qr, const int* seg, T* dk, T* dv) {
  constexpr int PAD = 8, SQ = D + PAD, SP = BQ + PAD, THREADS = 256;
  constexpr int NKG = BKV / 16;             // key groups of 16
  constexpr int NCG = 8 / NKG;              // column groups (phase 2) / query groups (phase 1)
  constexpr int CW = D / NCG;               // columns a warp owns in phase 2
  constexpr int NT = (BQ / 8) / NCG;        // n-tiles of 8 queries a warp computes in phase 1
  static_assert(NKG * NCG == 8, "8 warps");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BKV * SQ;
  T* sQ = sV + BKV * SQ;
  T* sO = sQ + BQ * SQ;  // dO
  T* sP = sO + BQ * SQ;
  T* sS = sP + BKV * SP;  // dS
  float* sL = reinterpret_cast<float*>(sS + BKV * SP);
  float* sD = sL + BQ;
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int kb = blockIdx.x, bhk = blockIdx.y;
  const int b = bhk / Hkv, hk = bhk % Hkv, rep = H / Hkv;
  const int k0 = kb * BKV;
  const T* kp = k + (size_t)bhk * Lk * D;
  const T* vp = v + (size_t)bhk * Lk * D;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kg = warp % NKG, cg = warp / NKG;
  const float scale = scale_p[0], sl2 = scale * SBFLASH_LOG2E;

  load_tile<T, BKV, D, SQ, THREADS>(sK, kp, k0, Lk, D);
  load_tile<T, BKV, D, SQ, THREADS>(sV, vp, k0, Lk, D);

  float adk[CW / 8][4], adv[CW / 8][4];
#pragma unroll
  for (int n = 0; n < CW / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) adk[n][e] = adv[n][e] = 0.f;

  const int qstart = max(qr[2 * kb], 0), qend = min(qr[2 * kb + 1], Lq);
  for (int hh = 0; hh < rep; ++hh) {
    const int h = hk * rep + hh;
    const size_t row_base = (size_t)(b * H + h) * Lq;
    for (int q0 = (qstart / BQ) * BQ; q0 < qend; q0 += BQ) {
      __syncthreads();
      load_tile<T, BQ, D, SQ, THREADS>(sQ, q + row_base * D, q0, Lq, D);
      load_tile<T, BQ, D, SQ, THREADS>(sO, d_o + row_base * D, q0, Lq, D);
      for (int i = threadIdx.x; i < BQ; i += THREADS) {
        bool in = q0 + i < Lq;
        sL[i] = in ? lse[row_base + q0 + i] : 0.f;
        sD[i] = in ? delta[row_base + q0 + i] : 0.f;
      }
      __syncthreads();

      // Phase 1: S^T = K Q^T and dP^T = V dO^T for keys kg*16.. and NT tiles of 8 queries.
      float st[NT][4], dpt[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll 2
      for (int kk = 0; kk < D / 16; ++kk) {
        const T* ka = sK + (kg * 16 + g) * SQ + kk * 16 + 2 * t;
        const T* va = sV + (kg * 16 + g) * SQ + kk * 16 + 2 * t;
        uint32_t a0 = ld32(ka), a1 = ld32(ka + 8 * SQ), a2 = ld32(ka + 8), a3 = ld32(ka + 8 * SQ + 8);
        uint32_t c0 = ld32(va), c1 = ld32(va + 8 * SQ), c2 = ld32(va + 8), c3 = ld32(va + 8 * SQ + 8);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          int qn = (cg * NT + n) * 8 + g;
          const T* qb_ = sQ + qn * SQ + kk * 16 + 2 * t;
          const T* ob_ = sO + qn * SQ + kk * 16 + 2 * t;
          mma<T>(st[n], a0, a1, a2, a3, ld32(qb_), ld32(qb_ + 8));
          mma<T>(dpt[n], c0, c1, c2, c3, ld32(ob_), ld32(ob_ + 8));
        }
      }
      dkdv_probs<T, SEG, NT, SP>(st, dpt, sP, sS, sL, sD, q0, k0, kg, cg, sl2, false, Lq, Lk,
                                 off, W, segb);
      __syncthreads();

      // Phase 2: dV += P^T dO, dK += dS^T Q on keys kg*16.., columns cg*CW...
#pragma unroll
      for (int j = 0; j < BQ / 16; ++j) {
        const T* pa = sP + (kg * 16 + g) * SP + j * 16 + 2 * t;
        const T* sa = sS + (kg * 16 + g) * SP + j * 16 + 2 * t;
        uint32_t a0 = ld32(pa), a1 = ld32(pa + 8 * SP), a2 = ld32(pa + 8), a3 = ld32(pa + 8 * SP + 8);
        uint32_t e0 = ld32(sa), e1 = ld32(sa + 8 * SP), e2 = ld32(sa + 8), e3 = ld32(sa + 8 * SP + 8);
#pragma unroll
        for (int n = 0; n < CW / 8; ++n) {
          const int c = cg * CW + n * 8;
          uint32_t b0, b1, f0, f1;
          b_frag_trans<T, SQ, LDSM>(sO + j * 16 * SQ + c, b0, b1);
          b_frag_trans<T, SQ, LDSM>(sQ + j * 16 * SQ + c, f0, f1);
          mma<T>(adv[n], a0, a1, a2, a3, b0, b1);
          mma<T>(adk[n], e0, e1, e2, e3, f0, f1);
        }
      }
    }
  }

  const int r0 = k0 + kg * 16 + g, r1 = r0 + 8;
  const size_t at = (size_t)bhk * Lk * D + cg * CW;
  store_rows<T, CW / 8>(dk + at, D, r0, r1, Lk, adk, scale, scale);
  store_rows<T, CW / 8>(dv + at, D, r0, r1, Lk, adv, 1.f, 1.f);
}

// ---------------------------------------------------------------------------------------------
// dQ: one CTA of 4 warps per 64 query rows of one (batch, head) and one slice of DQ columns
// (blockIdx.z); it recomputes S and dP for every key block the rows see.
template <typename T, int D, int DQ, int BK, int SEG, int LDSM>
__device__ void backward_dq(const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                            const float* delta, const float* scale_p, const int* prm,
                            const int* kr, const int* seg, T* dq) {
  constexpr int BQ = 64, PAD = 8, SQ = D + PAD, THREADS = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + BQ * SQ;
  T* sK = sO + BQ * SQ;
  T* sV = sK + BK * SQ;
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int qb = blockIdx.x, bh = blockIdx.y, zs = blockIdx.z;
  const int b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int q0 = qb * BQ;
  const T* kp = k + (size_t)(b * Hkv + hk) * Lk * D;
  const T* vp = v + (size_t)(b * Hkv + hk) * Lk * D;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale = scale_p[0], sl2 = scale * SBFLASH_LOG2E;
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;

  load_tile<T, BQ, D, SQ, THREADS>(sQ, q + (size_t)bh * Lq * D, q0, Lq, D);
  load_tile<T, BQ, D, SQ, THREADS>(sO, d_o + (size_t)bh * Lq * D, q0, Lq, D);
  const float lse0 = r0 < Lq ? lse[(size_t)bh * Lq + r0] * SBFLASH_LOG2E : 0.f;
  const float lse1 = r1 < Lq ? lse[(size_t)bh * Lq + r1] * SBFLASH_LOG2E : 0.f;
  const float dl0 = r0 < Lq ? delta[(size_t)bh * Lq + r0] : 0.f;
  const float dl1 = r1 < Lq ? delta[(size_t)bh * Lq + r1] : 0.f;

  float acc[DQ / 8][4];
#pragma unroll
  for (int n = 0; n < DQ / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const int kstart = max(kr[2 * qb], 0), kend = min(kr[2 * qb + 1], Lk);

  for (int k0 = (kstart / BK) * BK; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tile<T, BK, D, SQ, THREADS>(sK, kp, k0, Lk, D);
    load_tile<T, BK, D, SQ, THREADS>(sV, vp, k0, Lk, D);
    __syncthreads();

    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* qa = sQ + (warp * 16 + g) * SQ + kk * 16 + 2 * t;
      const T* oa = sO + (warp * 16 + g) * SQ + kk * 16 + 2 * t;
      uint32_t a0 = ld32(qa), a1 = ld32(qa + 8 * SQ), a2 = ld32(qa + 8), a3 = ld32(qa + 8 * SQ + 8);
      uint32_t c0 = ld32(oa), c1 = ld32(oa + 8 * SQ), c2 = ld32(oa + 8), c3 = ld32(oa + 8 * SQ + 8);
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        const T* kb_ = sK + (n * 8 + g) * SQ + kk * 16 + 2 * t;
        const T* vb_ = sV + (n * 8 + g) * SQ + kk * 16 + 2 * t;
        mma<T>(s[n], a0, a1, a2, a3, ld32(kb_), ld32(kb_ + 8));
        mma<T>(dp[n], c0, c1, c2, c3, ld32(vb_), ld32(vb_ + 8));
      }
    }
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int col = k0 + n * 8 + 2 * t + (e & 1);
        int row = e < 2 ? r0 : r1;
        bool vis = visible<SEG>(row, col, Lq, Lk, off, W, segb);
        float p = vis ? exp2f(s[n][e] * sl2 - (e < 2 ? lse0 : lse1)) : 0.f;
        s[n][e] = p * (dp[n][e] - (e < 2 ? dl0 : dl1));  // dS
      }
    }
    mma_regs_smem<T, BK / 8, DQ / 8, SQ, LDSM>(acc, s, sK + zs * DQ);
  }

  store_rows<T, DQ / 8>(dq + (size_t)bh * Lq * D + zs * DQ, D, r0, r1, Lq, acc, scale, scale);
}

}  // namespace sbflash
