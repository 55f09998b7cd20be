// bfloat16 matmul on Intel AMX tiles, for calls with many rows (pagoda.kernels.cpu_gemm;
// cpu_gemm.cpp's packed bfloat16 panels are AMX's B-tile layout as they are).
//
// One register block is 32 rows x 32 columns: two A tiles (16 rows x 32 k of x, read from x
// in place), two B tiles (16 k pairs x 16 columns: 1 KB of one panel), four float32 C tiles.
// TDPBF16PS accumulates in float32 over the whole K; the sums are rounded to bfloat16 once
// (plus bias, as F.linear). AMX adds a k pair's two products in its own order (Intel's
// definition), not vdpbf16ps's, so a row's bits may differ between a call this serves and
// one cpu_gemm.cpp's vector tiles serve (both within the float32-accumulation bound).
// Rows past a multiple of 16 run with tiles configured for fewer rows.
// int8 (W8A8, cpu_int8.cpp): the same blocking with TDPBSSD (int8 x int8 summed in int32,
// exactly: every kernel gives the same sums), A tiles 16 rows x 64 k of the quantized x, B
// tiles 16 k quads x 16 columns (cpu_int8.cpp's panels as they are).
//
// Linux hands AMX's tile state to a process only once asked (arch_prctl
// ARCH_REQ_XCOMP_PERM): amx_usable() asks once and says whether it was granted; without
// it (or without AMX at build time) the vector tiles serve every call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_gemm.h"

namespace pagoda_gemm {

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)

namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ARCH_REQ_XCOMP_PERM
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {  // the 64-byte operand of LDTILECFG (palette 1)
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (rows x 16 float32), 4-5: A (rows x 32 bf16), 6-7: B (16 pairs x 16 columns x 2).
void configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = rows, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = rows, config.colsb[t] = 64;
  for (int t = 6; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  // GCC 12 does not see LDTILECFG read its operand and may drop the stores above: say it does.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The two kinds of tiles: bfloat16 pairs summed in float32 (TDPBF16PS, 32 k per step) and int8
// quads summed in int32 (TDPBSSD, 64 k per step); a step reads 64 bytes of each A row. The four
// products of a block are spelled out: GCC's intrinsics are macros that paste the tile numbers
// into the instruction text, so they must be literals.
struct Bf16Tiles {
  using In = uint16_t;
  using Sum = float;
  static constexpr int64_t kStep = 32;
  static void dot_0_4_6() { _tile_dpbf16ps(0, 4, 6); }
  static void dot_1_4_7() { _tile_dpbf16ps(1, 4, 7); }
  static void dot_2_5_6() { _tile_dpbf16ps(2, 5, 6); }
  static void dot_3_5_7() { _tile_dpbf16ps(3, 5, 7); }
};

#if defined(__AMX_INT8__)
struct Int8Tiles {
  using In = int8_t;
  using Sum = int32_t;
  static constexpr int64_t kStep = 64;
  static void dot_0_4_6() { _tile_dpbssd(0, 4, 6); }
  static void dot_1_4_7() { _tile_dpbssd(1, 4, 7); }
  static void dot_2_5_6() { _tile_dpbssd(2, 5, 6); }
  static void dot_3_5_7() { _tile_dpbssd(3, 5, 7); }
};
#endif

// C[rows of two A tiles, two panels] over K: a0/a1 the first x rows of each half (row
// stride ldx elements), w0 the first panel (the second at w0 + ldw: 64 bytes per k step and
// column group, so w0 + i * 16 elements at k = i for both kinds), sums [32][32].
template <typename Tiles, bool two_halves, bool two_panels>
void block(const typename Tiles::In* a0, int64_t ldx, const typename Tiles::In* w0, int64_t ldw, int64_t k,
           typename Tiles::Sum* sums) {
  constexpr int64_t row_bytes = sizeof(typename Tiles::In);
  _tile_zero(0);
  if (two_panels) _tile_zero(1);
  if (two_halves) _tile_zero(2);
  if (two_halves && two_panels) _tile_zero(3);
  const typename Tiles::In* a1 = a0 + 16 * ldx;
  for (int64_t i = 0; i < k; i += Tiles::kStep) {
    _tile_loadd(4, a0 + i, ldx * row_bytes);
    _tile_loadd(6, w0 + i * 16, 64);
    Tiles::dot_0_4_6();
    if (two_panels) {
      _tile_loadd(7, w0 + ldw + i * 16, 64);
      Tiles::dot_1_4_7();
    }
    if (two_halves) {
      _tile_loadd(5, a1 + i, ldx * row_bytes);
      Tiles::dot_2_5_6();
      if (two_panels) Tiles::dot_3_5_7();
    }
  }
  _tile_stored(0, sums, 32 * 4);
  if (two_panels) _tile_stored(1, sums + 16, 32 * 4);
  if (two_halves) _tile_stored(2, sums + 16 * 32, 32 * 4);
  if (two_halves && two_panels) _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
}

// out's blocks of up to 32 rows x 32 columns, split across torch's threads by row chunk and
// panel pair; finish(sums, first row, rows, first column, columns) writes each block's sums.
template <typename Tiles, typename Finish>
void run_blocks(const typename Tiles::In* x, int64_t ldx, const typename Tiles::In* packed, int64_t ldw, int64_t rows,
                int64_t n, int64_t k, const Finish& finish) {
  const int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2;
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(typename Tiles::In));
  const int64_t chunk_rows = std::max<int64_t>(32, (256 * 1024) / row_bytes / 32 * 32);  // x rows kept in L2
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) typename Tiles::Sum sums[32 * 32];
    int configured = 0;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pair = t % pairs, r0 = (t / pairs) * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
      const int64_t p0 = pair * 2, col0 = p0 * 16, cols = std::min<int64_t>(32, n - col0);
      const bool two_panels = p0 + 1 < panels;
      for (int64_t r = r0; r < r1;) {
        const int64_t left = r1 - r, take = left >= 32 ? 32 : std::min<int64_t>(16, left);
        const int tile_rows = static_cast<int>(std::min<int64_t>(16, take));
        if (tile_rows != configured) configure(configured = tile_rows);
        auto run = take == 32 ? (two_panels ? &block<Tiles, true, true> : &block<Tiles, true, false>)
                              : (two_panels ? &block<Tiles, false, true> : &block<Tiles, false, false>);
        run(x + r * ldx, ldx, packed + p0 * ldw, ldw, k, sums);
        finish(sums, r, take, col0, cols);
        r += take;
      }
    }
    _tile_release();
  });
}

#if defined(__AMX_INT8__)
template <typename T>
bool run_int8(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
              int64_t n, const float* ws, const float* bias, T* out) {
  if (kp % 64 != 0 || !amx_int8_usable()) return false;
  run_blocks<Int8Tiles>(xq, kp, packed, ldw, rows, n, kp,
                        [&](const int32_t* sums, int64_t r, int64_t take, int64_t col0, int64_t cols) {
                          finish_int8(sums, 32, take, cols, nullptr, xs + r, ws + col0, bias ? bias + col0 : nullptr,
                                      out + r * n + col0, n);
                        });
  return true;
}
#endif

}  // namespace

bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

bool amx_int8_usable() {
#if defined(__AMX_INT8__)
  return amx_usable();
#else
  return false;
#endif
}

bool amx_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t ldw, int64_t rows, int64_t n,
                     int64_t k, const float* bias, c10::BFloat16* out) {
  if (k % 32 != 0 || !amx_usable()) return false;  // A tiles read 32 k at a time from x in place
  run_blocks<Bf16Tiles>(x, ldx, packed, ldw, rows, n, k,
                        [&](const float* sums, int64_t r, int64_t take, int64_t col0, int64_t cols) {
                          store_sums(sums, 32, take, cols, bias ? bias + col0 : nullptr, out + r * n + col0, n);
                        });
  return true;
}

bool amx_linear_int8(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
                     int64_t n, const float* ws, const float* bias, float* out) {
#if defined(__AMX_INT8__)
  return run_int8(xq, xs, rows, kp, packed, ldw, n, ws, bias, out);
#else
  return false;
#endif
}

bool amx_linear_int8(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
                     int64_t n, const float* ws, const float* bias, c10::BFloat16* out) {
#if defined(__AMX_INT8__)
  return run_int8(xq, xs, rows, kp, packed, ldw, n, ws, bias, out);
#else
  return false;
#endif
}

#else

bool amx_usable() { return false; }

bool amx_linear_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                     c10::BFloat16*) {
  return false;
}

bool amx_int8_usable() { return false; }

bool amx_linear_int8(const int8_t*, const float*, int64_t, int64_t, const int8_t*, int64_t, int64_t, const float*,
                     const float*, float*) {
  return false;
}

bool amx_linear_int8(const int8_t*, const float*, int64_t, int64_t, const int8_t*, int64_t, int64_t, const float*,
                     const float*, c10::BFloat16*) {
  return false;
}

#endif

}  // namespace pagoda_gemm
