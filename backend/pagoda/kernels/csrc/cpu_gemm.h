// What cpu_gemm.cpp (the vector tiles, the op) and cpu_amx.cpp (AMX tiles) share.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pagoda_gemm {

// The register-tile kernel for mr rows and np panels (1..8 x 1..3): Tile::fn<MR, NP>, one table
// per Tile (cpu_gemm.cpp's float/bfloat16 tiles, cpu_int8.cpp's int8 ones).
template <typename Fn, typename Tile>
Fn tile_table(int64_t mr, int64_t np) {
  static const Fn table[8][3] = {
      {Tile::template fn<1, 1>, Tile::template fn<1, 2>, Tile::template fn<1, 3>},
      {Tile::template fn<2, 1>, Tile::template fn<2, 2>, Tile::template fn<2, 3>},
      {Tile::template fn<3, 1>, Tile::template fn<3, 2>, Tile::template fn<3, 3>},
      {Tile::template fn<4, 1>, Tile::template fn<4, 2>, Tile::template fn<4, 3>},
      {Tile::template fn<5, 1>, Tile::template fn<5, 2>, Tile::template fn<5, 3>},
      {Tile::template fn<6, 1>, Tile::template fn<6, 2>, Tile::template fn<6, 3>},
      {Tile::template fn<7, 1>, Tile::template fn<7, 2>, Tile::template fn<7, 3>},
      {Tile::template fn<8, 1>, Tile::template fn<8, 2>, Tile::template fn<8, 3>}};
  return table[mr - 1][np - 1];
}

// Finished float32 sums (c: rows x cols, row stride ldc) plus bias into out (row stride ldo).
void store_sums(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, float* out, int64_t ldo);
void store_sums(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, c10::BFloat16* out,
                int64_t ldo);

// Whether this process may use AMX tiles (asked of Linux once; false without AMX at build time).
bool amx_usable();

// out = x W^T + bias on AMX for bfloat16 panels (cpu_gemm.cpp's layout); false when it cannot
// serve the call (no AMX, K not a multiple of 32), and then it did nothing.
bool amx_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t ldw, int64_t rows, int64_t n,
                     int64_t k, const float* bias, c10::BFloat16* out);

// W8A8 (cpu_int8.cpp): out = float(sums - comp) * (xs[row] * ws[col]) + bias, rounded to out's
// dtype once; comp may be null (sums of signed x signed products need none).
void finish_int8(const int32_t* c, int64_t ldc, int64_t rows, int64_t cols, const int32_t* comp, const float* xs,
                 const float* ws, const float* bias, float* out, int64_t ldo);
void finish_int8(const int32_t* c, int64_t ldc, int64_t rows, int64_t cols, const int32_t* comp, const float* xs,
                 const float* ws, const float* bias, c10::BFloat16* out, int64_t ldo);

// Whether AMX-INT8 tiles serve here (built with them, and AMX granted by Linux).
bool amx_int8_usable();

// out = the W8A8 matmul of the quantized rows xq [rows, kp] (scales xs) by cpu_int8.cpp's
// packed int8 panels on AMX-INT8; false when it cannot serve (then it did nothing).
bool amx_linear_int8(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
                     int64_t n, const float* ws, const float* bias, float* out);
bool amx_linear_int8(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
                     int64_t n, const float* ws, const float* bias, c10::BFloat16* out);

}  // namespace pagoda_gemm
