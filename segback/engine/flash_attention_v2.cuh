// Flash attention v2 kernels for segback: appended to flash_attention.cuh (uses its helpers:
// mma, pack_f2, visible, neg_inf, the softmax and store steps), selected with variant="v2".
//
// Same algorithm and arithmetic as v1 (online softmax in base 2, LSE saved, P and dS rounded to
// the input dtype before each product, fp32 accumulation, dQ in its own pass: deterministic),
// different data movement:
//   * global -> shared through cp.async (16 B, zero-filled past the end), issued a phase ahead
//     so the copy overlaps the tensor-core work (forward / dQ: FA2's staggered single buffers;
//     dK/dV: double-buffered Q / dO tiles);
//   * every mma operand through ldmatrix (x4: two n-tiles or one A fragment per instruction);
//   * 128-row query blocks of 8 warps for D <= 256 (K/V tiles shared by twice the rows);
//     D = 512 splits the output columns over two warps per 16 rows (WN = 2) and shares the
//     score tile through shared memory instead of computing S twice;
//   * tiles wholly visible skip the per-element mask; query blocks run heaviest first.
//
// prm, layouts, kr / qr: as v1.

namespace sbflash {

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool pred) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [r0, r0 + ROWS) of a row-major global [*, COLS] array into shared memory (row stride
// SS), asynchronously; rows at or past n are zero-filled (their source address is clamped to
// row 0, never read). Each thread copies one 16-byte column chunk of every THREADS / (COLS / 8)
// rows, so its addresses are one base plus compile-time offsets (nothing hoisted per copy).
template <typename T, int ROWS, int COLS, int SS, int THREADS>
__device__ __forceinline__ void async_tile(T* dst, const T* src, int r0, int n) {
  constexpr int PER_ROW = COLS / 8, STEP = THREADS / PER_ROW;
  static_assert(THREADS % PER_ROW == 0 && ROWS % STEP == 0, "whole rounds of 16-byte copies");
  const int r = threadIdx.x / PER_ROW, c = (threadIdx.x % PER_ROW) * 8;
  const int left = n - r0 - r;  // rows of this thread's column still in range
  const T* s = src + (size_t)(r0 + r) * COLS + c;
  T* d = dst + r * SS + c;
#pragma unroll
  for (int it = 0; it < ROWS / STEP; ++it) {
    bool in = it * STEP < left;
    cp_async16(d + it * STEP * SS, in ? s + it * STEP * COLS : src, in);
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A fragment (16 x 16) of a row-major tile at p = &tile[row0][k0], row stride S.
template <int S, typename T>
__device__ __forceinline__ void lda(const T* p, uint32_t (&a)[4]) {
  const int lane = threadIdx.x % 32;
  uint32_t addr = smem_addr(p + (lane % 16) * S + (lane / 16) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// B fragments of two n-tiles (n0.., n0 + 8..) from an [n][k] tile at p = &tile[n0][k0]:
// b[0], b[1] for n-tile 0, b[2], b[3] for n-tile 1.
template <int S, typename T>
__device__ __forceinline__ void ldb_nk2(const T* p, uint32_t (&b)[4]) {
  const int lane = threadIdx.x % 32;
  uint32_t addr = smem_addr(p + ((lane % 8) + (lane / 16) * 8) * S + ((lane / 8) % 2) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(addr));
}

// B fragment of one n-tile from an [n][k] tile at p = &tile[n0][k0].
template <int S, typename T>
__device__ __forceinline__ void ldb_nk1(const T* p, uint32_t& b0, uint32_t& b1) {
  const int lane = threadIdx.x % 32;
  uint32_t addr = smem_addr(p + (lane % 8) * S + ((lane / 8) % 2) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(b0), "=r"(b1)
               : "r"(addr));
}

// B fragments of two n-tiles from a [k][n] tile at p = &tile[k0][n0] (ldmatrix.trans).
template <int S, typename T>
__device__ __forceinline__ void ldb_kn2(const T* p, uint32_t (&b)[4]) {
  const int lane = threadIdx.x % 32;
  uint32_t addr = smem_addr(p + (lane % 16) * S + (lane / 16) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma4(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                     uint32_t b1) {
  mma<T>(d, a[0], a[1], a[2], a[3], b0, b1);
}

// acc[NT] (16 rows x NT*8 columns) += A (16 x D, row-major at pa, stride SA) x B^T where B is
// an [n][k] tile at pb (NT*8 rows, stride SB): S = Q K^T and its kin.
template <typename T, int D, int NT, int SA, int SB, int UNROLL>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const T* pa, const T* pb) {
  static_assert(NT % 2 == 0, "pairs of n-tiles");
#pragma unroll UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    lda<SA>(pa + kk * 16, a);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      uint32_t b[4];
      ldb_nk2<SB>(pb + n * 8 * SB + kk * 16, b);
      mma4<T>(acc[n], a, b[0], b[1]);
      mma4<T>(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// acc[NC] (16 rows x NC*8 columns) += A (16 x K16*16 from shared, stride SA) x B where B is a
// [k][n] tile at pb (stride SB): O += P V with P in shared memory.
template <typename T, int K16, int NC, int SA, int SB>
__device__ __forceinline__ void mma_ab_smem(float (&acc)[NC][4], const T* pa, const T* pb) {
#pragma unroll
  for (int j = 0; j < K16; ++j) {
    uint32_t a[4];
    lda<SA>(pa + j * 16, a);
#pragma unroll
    for (int n = 0; n < NC; n += 2) {
      uint32_t b[4];
      ldb_kn2<SB>(pb + j * 16 * SB + n * 8, b);
      mma4<T>(acc[n], a, b[0], b[1]);
      mma4<T>(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// acc[NC] += A x B with A the 16 x NS*8 register tile s (C-fragment layout, rounded to T) and
// B a [k][n] tile at pb: O += P V with P in registers.
template <typename T, int NS, int NC, int SB>
__device__ __forceinline__ void mma_ab_regs(float (&acc)[NC][4], const float (&s)[NS][4],
                                            const T* pb) {
#pragma unroll
  for (int j = 0; j < NS / 2; ++j) {
    uint32_t a[4];
    a[0] = pack_f2<T>(s[2 * j][0], s[2 * j][1]);
    a[1] = pack_f2<T>(s[2 * j][2], s[2 * j][3]);
    a[2] = pack_f2<T>(s[2 * j + 1][0], s[2 * j + 1][1]);
    a[3] = pack_f2<T>(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
    for (int n = 0; n < NC; n += 2) {
      uint32_t b[4];
      ldb_kn2<SB>(pb + j * 16 * SB + n * 8, b);
      mma4<T>(acc[n], a, b[0], b[1]);
      mma4<T>(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// The register tile s (16 x NS*8, C-fragment layout) rounded to T into shared memory at p =
// &tile[row0][col0] (row stride S).
template <typename T, int NS, int S>
__device__ __forceinline__ void store_frag(T* p, const float (&s)[NS][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < NS; ++n) {
    *reinterpret_cast<uint32_t*>(p + g * S + n * 8 + 2 * t) = pack_f2<T>(s[n][0], s[n][1]);
    *reinterpret_cast<uint32_t*>(p + (g + 8) * S + n * 8 + 2 * t) = pack_f2<T>(s[n][2], s[n][3]);
  }
}

// Whether every pair of queries [i0, i0 + ni) and keys [j0, j0 + nj) is visible (no example
// ids): the tile can skip the per-element mask.
__device__ __forceinline__ bool all_visible(int i0, int ni, int j0, int nj, int Lq, int Lk,
                                            int off, int W) {
  return i0 + ni <= Lq && j0 + nj <= Lk && j0 + nj - 1 <= i0 + off &&
         (W == 0 || j0 > i0 + ni - 1 + off - W);
}

// s[n][e] of rows r0 (e < 2) / r0 + 8, columns c0 + n*8 + 2t + (e & 1): masked entries become
// `masked`, visible ones are left alone (the caller applies the scale).
template <int SEG, int NS>
__device__ __forceinline__ void mask_tile(float (&s)[NS][4], int r0, int c0, int Lq, int Lk,
                                          int off, int W, const int* seg, float masked) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < NS; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int col = c0 + n * 8 + 2 * t + (e & 1), row = e < 2 ? r0 : r0 + 8;
      if (!visible<SEG>(row, col, Lq, Lk, off, W, seg)) s[n][e] = masked;
    }
}

// ---------------------------------------------------------------------------------------------
// Forward: one CTA of WM x WN warps per BQ = 16 WM query rows of one (batch, head). Warp (wm,
// wn) owns rows wm*16.. and output columns wn*D/WN..; it computes the scores of its rows for
// keys wn*BK/WN.. of each key tile. WN = 1: P stays in registers; WN > 1: the row max is
// exchanged through shared memory and P goes through shared memory to every warp of the row.
// Pipeline per key tile j: [K(j) landed] issue V(j); S = Q K^T; softmax; [V(j) landed, every
// warp done with K(j)] issue K(j+1); O += P V.
template <typename T, int D, int BQ, int BK, int WN, int SEG>
__device__ void forward_v2(const T* q, const T* k, const T* v, const float* scale_p,
                           const int* prm, const int* kr, const int* seg, T* o, float* lse) {
  constexpr int WM = BQ / 16, THREADS = WM * WN * 32, SQ = D + 8, SP = BK + 8;
  constexpr int KW = BK / WN, DW = D / WN, NS = KW / 8, NC = DW / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BQ * SQ;
  T* sV = sK + BK * SQ;
  T* sP = sV + BK * SQ;                                  // WN > 1 only: [BQ][SP]
  float* sM = reinterpret_cast<float*>(sP + BQ * SP);    // WN > 1 only: [WN][BQ]
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;  // heaviest (causal) first
  const int b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int q0 = qb * BQ;
  const T* qp = q + (size_t)bh * Lq * D;
  const T* kp = k + (size_t)(b * Hkv + hk) * Lk * D;
  const T* vp = v + (size_t)(b * Hkv + hk) * Lk * D;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp % WM, wn = warp / WM;
  const float sl2 = scale_p[0] * SBFLASH_LOG2E;
  const int rw = q0 + wm * 16, r0 = rw + g, r1 = r0 + 8;
  const int kstart = max(kr[2 * qb], 0), kend = min(kr[2 * qb + 1], Lk);
  const int kfirst = (kstart / BK) * BK;

  async_tile<T, BQ, D, SQ, THREADS>(sQ, qp, q0, Lq);
  async_tile<T, BK, D, SQ, THREADS>(sK, kp, kfirst, Lk);
  cp_commit();

  float acc[NC][4];
#pragma unroll
  for (int n = 0; n < NC; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;

  for (int k0 = kfirst; k0 < kend; k0 += BK) {
    cp_wait<0>();
    __syncthreads();  // K(j) landed; every warp done with V(j-1) and sP
    async_tile<T, BK, D, SQ, THREADS>(sV, vp, k0, Lk);
    cp_commit();

    float s[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    mma_abt<T, D, NS, SQ, SQ, 2>(s, sQ + wm * 16 * SQ, sK + wn * KW * SQ);

    const int c0 = k0 + wn * KW;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= sl2;
    if (SEG || !all_visible(rw, 16, c0, KW, Lq, Lk, off, W))
      mask_tile<SEG, NS>(s, r0, c0, Lq, Lk, off, W, segb, neg_inf());

    float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    if constexpr (WN > 1) {
      if (t == 0) {
        sM[wn * BQ + wm * 16 + g] = mx0;
        sM[wn * BQ + wm * 16 + g + 8] = mx1;
      }
      __syncthreads();
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        mx0 = fmaxf(mx0, sM[w * BQ + wm * 16 + g]);
        mx1 = fmaxf(mx1, sM[w * BQ + wm * 16 + g + 8]);
      }
    }
    online_softmax<NS, NC>(s, acc, m0, m1, l0, l1, mx0, mx1);
    if constexpr (WN > 1) store_frag<T, NS, SP>(sP + wm * 16 * SP + wn * KW, s);

    cp_wait<0>();
    __syncthreads();  // V(j) landed, sP complete, every warp done with K(j)
    if (k0 + BK < kend) async_tile<T, BK, D, SQ, THREADS>(sK, kp, k0 + BK, Lk);
    cp_commit();

    if constexpr (WN > 1) {
      mma_ab_smem<T, BK / 16, NC, SP, SQ>(acc, sP + wm * 16 * SP, sV + wn * DW);
    } else {
      mma_ab_regs<T, NS, NC, SQ>(acc, s, sV);
    }
  }
  cp_wait<0>();

  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  if constexpr (WN > 1) {  // each warp of a row summed its own keys (same running max)
    __syncthreads();
    if (t == 0) {
      sM[wn * BQ + wm * 16 + g] = l0;
      sM[wn * BQ + wm * 16 + g + 8] = l1;
    }
    __syncthreads();
    l0 = l1 = 0.f;
#pragma unroll
    for (int w = 0; w < WN; ++w) {
      l0 += sM[w * BQ + wm * 16 + g];
      l1 += sM[w * BQ + wm * 16 + g + 8];
    }
  }
  float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  store_rows<T, NC>(o + (size_t)bh * Lq * D + wn * DW, D, r0, r1, Lq, acc, inv0, inv1);
  if (wn == 0 && t == 0) store_lse(lse + (size_t)bh * Lq, r0, r1, Lq, m0, l0, m1, l1);
}

// ---------------------------------------------------------------------------------------------
// dQ: one CTA of WM x WN warps per BQ = 16 WM query rows, warps laid out as the forward's.
// Pipeline per key tile j: [V(j) landed] dP = dO V^T; [K(j) landed, every warp done with V(j)]
// issue V(j+1); S = Q K^T, dS = P (dP - delta); (WN > 1: dS through shared memory)
// dQ += dS K; [every warp done with K(j)] issue K(j+1).
template <typename T, int D, int BQ, int BK, int WN, int SEG>
__device__ void backward_dq_v2(const T* q, const T* k, const T* v, const T* d_o,
                               const float* lse, const float* delta, const float* scale_p,
                               const int* prm, const int* kr, const int* seg, T* dq) {
  constexpr int WM = BQ / 16, THREADS = WM * WN * 32, SQ = D + 8, SP = BK + 8;
  constexpr int KW = BK / WN, DW = D / WN, NS = KW / 8, NC = DW / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + BQ * SQ;
  T* sK = sO + BQ * SQ;
  T* sV = sK + BK * SQ;
  T* sS = sV + BK * SQ;  // WN > 1 only: [BQ][SP]
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
  const int b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int q0 = qb * BQ;
  const T* kp = k + (size_t)(b * Hkv + hk) * Lk * D;
  const T* vp = v + (size_t)(b * Hkv + hk) * Lk * D;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const int wm = warp % WM, wn = warp / WM;
  const float scale = scale_p[0], sl2 = scale * SBFLASH_LOG2E;
  const int rw = q0 + wm * 16, r0 = rw + g, r1 = r0 + 8;
  const int kstart = max(kr[2 * qb], 0), kend = min(kr[2 * qb + 1], Lk);
  const int kfirst = (kstart / BK) * BK;

  async_tile<T, BQ, D, SQ, THREADS>(sQ, q + (size_t)bh * Lq * D, q0, Lq);
  async_tile<T, BQ, D, SQ, THREADS>(sO, d_o + (size_t)bh * Lq * D, q0, Lq);
  async_tile<T, BK, D, SQ, THREADS>(sV, vp, kfirst, Lk);
  cp_commit();
  async_tile<T, BK, D, SQ, THREADS>(sK, kp, kfirst, Lk);
  cp_commit();
  const float lse0 = r0 < Lq ? lse[(size_t)bh * Lq + r0] * SBFLASH_LOG2E : 0.f;
  const float lse1 = r1 < Lq ? lse[(size_t)bh * Lq + r1] * SBFLASH_LOG2E : 0.f;
  const float dl0 = r0 < Lq ? delta[(size_t)bh * Lq + r0] : 0.f;
  const float dl1 = r1 < Lq ? delta[(size_t)bh * Lq + r1] : 0.f;

  float acc[NC][4];
#pragma unroll
  for (int n = 0; n < NC; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int k0 = kfirst; k0 < kend; k0 += BK) {
    const bool more = k0 + BK < kend;
    cp_wait<1>();
    __syncthreads();  // V(j) (and Q, dO) landed
    float dp[NS][4], s[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] = 0.f;
    mma_abt<T, D, NS, SQ, SQ, 2>(dp, sO + wm * 16 * SQ, sV + wn * KW * SQ);

    cp_wait<0>();
    __syncthreads();  // K(j) landed; every warp done with V(j)
    if (more) async_tile<T, BK, D, SQ, THREADS>(sV, vp, k0 + BK, Lk);
    cp_commit();
    mma_abt<T, D, NS, SQ, SQ, 2>(s, sQ + wm * 16 * SQ, sK + wn * KW * SQ);

    const int c0 = k0 + wn * KW;
    const bool full = !SEG && all_visible(rw, 16, c0, KW, Lq, Lk, off, W);
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = exp2f(s[n][e] * sl2 - (e < 2 ? lse0 : lse1));
    if (!full) mask_tile<SEG, NS>(s, r0, c0, Lq, Lk, off, W, segb, 0.f);
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s[n][e] * (dp[n][e] - (e < 2 ? dl0 : dl1));  // dS

    if constexpr (WN > 1) {
      store_frag<T, NS, SP>(sS + wm * 16 * SP + wn * KW, s);
      __syncthreads();
      mma_ab_smem<T, BK / 16, NC, SP, SQ>(acc, sS + wm * 16 * SP, sK + wn * DW);
    } else {
      mma_ab_regs<T, NS, NC, SQ>(acc, s, sK);
    }
    __syncthreads();  // every warp done with K(j) (and sS)
    if (more) async_tile<T, BK, D, SQ, THREADS>(sK, kp, k0 + BK, Lk);
    cp_commit();
  }
  cp_wait<0>();

  store_rows<T, NC>(dq + (size_t)bh * Lq * D + wn * DW, D, r0, r1, Lq, acc, scale, scale);
}

// ---------------------------------------------------------------------------------------------
// dK, dV: v1's decomposition (8 warps per BKV keys of one (batch, kv head), phase 1 P^T / dS^T
// into shared memory, phase 2 dV += P^T dO, dK += dS^T Q), with the Q / dO / LSE / delta tiles
// double-buffered through cp.async (tile i+1 copies while tile i computes) and every operand
// through ldmatrix.
template <typename T, int D, int BKV, int BQ, int SEG>
__device__ void backward_dkdv_v2(const T* q, const T* k, const T* v, const T* d_o,
                                 const float* lse, const float* delta, const float* scale_p,
                                 const int* prm, const int* qr, const int* seg, T* dk, T* dv) {
  constexpr int SQ = D + 8, SP = BQ + 8, THREADS = 256;
  constexpr int NKG = BKV / 16, NCG = 8 / NKG, CW = D / NCG, NT = (BQ / 8) / NCG;
  static_assert(NKG * NCG == 8, "8 warps");
  static_assert(CW % 16 == 0 && BQ <= THREADS / 2, "tiling");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BKV * SQ;
  T* sQ0 = sV + BKV * SQ;     // [2][BQ][SQ]
  T* sO0 = sQ0 + 2 * BQ * SQ;  // [2][BQ][SQ]
  T* sP = sO0 + 2 * BQ * SQ;
  T* sS = sP + BKV * SP;
  float* sL0 = reinterpret_cast<float*>(sS + BKV * SP);  // [2][BQ]
  float* sD0 = sL0 + 2 * BQ;                              // [2][BQ]
  const int H = prm[1], Hkv = prm[2], Lq = prm[3], Lk = prm[4], off = prm[5], W = prm[6];
  const int kb = blockIdx.x, bhk = blockIdx.y;
  const int b = bhk / Hkv, hk = bhk % Hkv, rep = H / Hkv;
  const int k0 = kb * BKV;
  const int* segb = SEG ? seg + (size_t)b * Lk : nullptr;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kg = warp % NKG, cg = warp / NKG;
  const float scale = scale_p[0], sl2 = scale * SBFLASH_LOG2E;

  const int qstart = max(qr[2 * kb], 0), qend = min(qr[2 * kb + 1], Lq);
  const int qfirst = (qstart / BQ) * BQ;
  const int nqb = qend > qfirst ? (qend - qfirst + BQ - 1) / BQ : 0;
  const int total = rep * nqb;

  // Tile `it` (head hk*rep + it / nqb, query block it % nqb) into buffer `buf`.
  auto issue = [&](int it, int buf) {
    const int h = hk * rep + it / nqb, q0 = qfirst + (it % nqb) * BQ;
    const size_t row_base = (size_t)(b * H + h) * Lq;
    async_tile<T, BQ, D, SQ, THREADS>(sQ0 + buf * BQ * SQ, q + row_base * D, q0, Lq);
    async_tile<T, BQ, D, SQ, THREADS>(sO0 + buf * BQ * SQ, d_o + row_base * D, q0, Lq);
    const int i = threadIdx.x % BQ;
    const bool in = q0 + i < Lq;
    const size_t at = row_base + (in ? q0 + i : 0);
    if (threadIdx.x < BQ) cp_async4(sL0 + buf * BQ + i, lse + at, in);
    else if (threadIdx.x < 2 * BQ) cp_async4(sD0 + buf * BQ + i, delta + at, in);
  };

  async_tile<T, BKV, D, SQ, THREADS>(sK, k + (size_t)bhk * Lk * D, k0, Lk);
  async_tile<T, BKV, D, SQ, THREADS>(sV, v + (size_t)bhk * Lk * D, k0, Lk);
  if (total > 0) issue(0, 0);
  cp_commit();

  float adk[CW / 8][4], adv[CW / 8][4];
#pragma unroll
  for (int n = 0; n < CW / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) adk[n][e] = adv[n][e] = 0.f;

  for (int it = 0; it < total; ++it) {
    const int buf = it & 1;
    const int q0 = qfirst + (it % nqb) * BQ;
    const T* sQ = sQ0 + buf * BQ * SQ;
    const T* sO = sO0 + buf * BQ * SQ;
    const float* sL = sL0 + buf * BQ;
    const float* sD = sD0 + buf * BQ;
    cp_wait<0>();
    __syncthreads();  // tile it landed; every warp done with tile it-1 (its buffer, sP, sS)
    if (it + 1 < total) issue(it + 1, buf ^ 1);
    cp_commit();

    // Phase 1: S^T = K Q^T and dP^T = V dO^T for keys kg*16.. and NT tiles of 8 queries.
    float st[NT][4], dpt[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      lda<SQ>(sK + kg * 16 * SQ + kk * 16, ak);
      lda<SQ>(sV + kg * 16 * SQ + kk * 16, av);
      const int qn = cg * NT * 8;
      if constexpr (NT % 2 == 0) {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          uint32_t bq_[4], bo[4];
          ldb_nk2<SQ>(sQ + (qn + n * 8) * SQ + kk * 16, bq_);
          ldb_nk2<SQ>(sO + (qn + n * 8) * SQ + kk * 16, bo);
          mma4<T>(st[n], ak, bq_[0], bq_[1]);
          mma4<T>(st[n + 1], ak, bq_[2], bq_[3]);
          mma4<T>(dpt[n], av, bo[0], bo[1]);
          mma4<T>(dpt[n + 1], av, bo[2], bo[3]);
        }
      } else {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          uint32_t b0, b1, c0, c1;
          ldb_nk1<SQ>(sQ + (qn + n * 8) * SQ + kk * 16, b0, b1);
          ldb_nk1<SQ>(sO + (qn + n * 8) * SQ + kk * 16, c0, c1);
          mma4<T>(st[n], ak, b0, b1);
          mma4<T>(dpt[n], av, c0, c1);
        }
      }
    }
    const bool full = !SEG && all_visible(q0 + cg * NT * 8, NT * 8, k0 + kg * 16, 16, Lq, Lk,
                                          off, W);
    dkdv_probs<T, SEG, NT, SP>(st, dpt, sP, sS, sL, sD, q0, k0, kg, cg, sl2, full, Lq, Lk, off,
                               W, segb);
    __syncthreads();

    // Phase 2: dV += P^T dO, dK += dS^T Q on keys kg*16.., columns cg*CW...
#pragma unroll
    for (int j = 0; j < BQ / 16; ++j) {
      uint32_t ap[4], as[4];
      lda<SP>(sP + kg * 16 * SP + j * 16, ap);
      lda<SP>(sS + kg * 16 * SP + j * 16, as);
#pragma unroll
      for (int n = 0; n < CW / 8; n += 2) {
        const int c = cg * CW + n * 8;
        uint32_t bo[4], bq_[4];
        ldb_kn2<SQ>(sO + j * 16 * SQ + c, bo);
        ldb_kn2<SQ>(sQ + j * 16 * SQ + c, bq_);
        mma4<T>(adv[n], ap, bo[0], bo[1]);
        mma4<T>(adv[n + 1], ap, bo[2], bo[3]);
        mma4<T>(adk[n], as, bq_[0], bq_[1]);
        mma4<T>(adk[n + 1], as, bq_[2], bq_[3]);
      }
    }
  }
  cp_wait<0>();

  const int r0 = k0 + kg * 16 + g, r1 = r0 + 8;
  const size_t at = (size_t)bhk * Lk * D + cg * CW;
  store_rows<T, CW / 8>(dk + at, D, r0, r1, Lk, adk, scale, scale);
  store_rows<T, CW / 8>(dv + at, D, r0, r1, Lk, adv, 1.f, 1.f);
}

}  // namespace sbflash
