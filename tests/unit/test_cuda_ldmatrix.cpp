// CPU emulation of ldmatrix.x4 and ldmatrix.x4.trans (PTX ISA 9.7.14.5.15) on the kernels' own
// shared-memory address expressions (src/cuda/warp/ldmatrix_addr.hpp, with the tile origins and
// padded row lengths of sddmm_select.cu and spmm.cu): for all 32 lanes, every register half must
// receive exactly the element that mma_fragments.hpp's fragment map assigns to it. The emulation
// is written from the PTX description alone: lane i's address is row i % 8 of matrix i / 8;
// register m of lane l holds (row l / 4, columns 2 (l % 4) + j) of matrix m, transposed with .trans.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/warp/ldmatrix_addr.hpp"
#include "cuda/warp/mma_fragments.hpp"

namespace {

namespace w = dfss::cuda::warp;

// A shared-memory tile of rows x stride 16-bit elements whose every element holds its own
// (row, column) encoded as row * 4096 + column, so a loaded value names where it came from.
struct tile {
  int rows;
  int stride;
  std::uint32_t at(int r, int c) const {
    EXPECT_GE(r, 0);
    EXPECT_LT(r, rows);
    EXPECT_GE(c, 0);
    EXPECT_LE(c + 8, stride) << "an 8-element ldmatrix row runs past the padded row";
    return static_cast<std::uint32_t>(r * 4096 + c);
  }
};
std::uint32_t code(int r, int c) { return static_cast<std::uint32_t>(r * 4096 + c); }

// regs[lane][m][j]: element j (0, 1) of register m of lane, as tile codes. addr(lane) = the (row,
// column) of the first of the 8 elements that lane's address points at.
using regs_t = std::vector<std::vector<std::vector<std::uint32_t>>>;

template <typename Addr>
regs_t ldmatrix_x4(const tile& t, Addr addr, bool trans) {
  regs_t out(32, std::vector<std::vector<std::uint32_t>>(4, std::vector<std::uint32_t>(2)));
  for (int lane = 0; lane < 32; ++lane) {
    const int t4 = lane % 4;
    for (int m = 0; m < 4; ++m) {
      for (int j = 0; j < 2; ++j) {
        // Element (row, col) of 8x8 matrix m: row `row` comes from the address of lane 8 m + row.
        const int row = trans ? 2 * t4 + j : lane / 4;
        const int col = trans ? lane / 4 : 2 * t4 + j;
        const w::smem_coord a = addr(8 * m + row);
        out[static_cast<std::size_t>(lane)][static_cast<std::size_t>(m)][static_cast<std::size_t>(j)] =
            t.at(a.row, a.col + col);
      }
    }
  }
  return out;
}

// Shared-memory shapes of the kernels (sddmm_select.cu: 64 keys per step, kPad = 8; spmm.cu: 64
// keys per step, kPad = 8). Q and P need no ldmatrix: the SDDMM loads its Q fragments and the SpMM
// its P fragments straight from global memory (mma_a16_coord; softmax_fold.hpp's fragment order).
constexpr int kPad = 8;

TEST(CudaLdmatrix, SddmmKLoadsPermutedBFragments) {
  for (int d : {64, 128}) {
    const tile ks{64, d + kPad};
    for (int wk = 0; wk < 2; ++wk) {
      for (int jp = 0; jp < 2; ++jp) {
        for (int kk = 0; kk < d; kk += 16) {
          const regs_t got = ldmatrix_x4(ks, [&](int l) {
            const w::smem_coord at = w::ldsm_sddmm16_b_x4(l, jp);
            return w::smem_coord{32 * wk + at.row, kk + at.col};
          }, false);
          // bf[0], bf[1]: B of n8 tile 2 jp; bf[2], bf[3]: n8 tile 2 jp + 1. B(k, n) of n8 tile j is
          // key (key of accumulator column 8 j + n), head-dim column kk + k, which the copy put in
          // shared-memory row sddmm16_smem_row_of_key(key) of its unit.
          for (int lane = 0; lane < 32; ++lane) {
            for (int half = 0; half < 2; ++half) {
              const int j = 2 * jp + half;
              for (int e = 0; e < 4; ++e) {
                const w::frag_coord c = w::mma_b16_coord(lane, e);
                const int key = w::sddmm16_key_of_column(8 * j + c.col);
                ASSERT_EQ(got[lane][2 * half + e / 2][e % 2], code(32 * wk + w::sddmm16_smem_row_of_key(key), kk + c.row))
                    << "d " << d << " wk " << wk << " jp " << jp << " kk " << kk << " lane " << lane << " b" << e;
              }
            }
          }
        }
      }
    }
  }
}

// The SDDMM's copy puts chunk row r0 + kPassRows it (r0 < kPassRows, kPassRows 8 or 16) at a
// per-thread base plus a per-chunk constant (sddmm16_copy_row_base / _offset): that must be the row
// sddmm16_smem_row(r), which holds key r % 32 of unit r / 32 where the ldmatrix above expects it,
// for every chunk of a step.
TEST(CudaLdmatrix, SddmmCopyRowsAreASumOfTwoParts) {
  for (int pass : {8, 16}) {
    for (int r0 = 0; r0 < pass; ++r0) {
      for (int it = 0; it < 64 / pass; ++it) {
        const int r = r0 + pass * it;
        ASSERT_EQ(w::sddmm16_copy_row_base(r0) + w::sddmm16_copy_row_offset(pass, it), w::sddmm16_smem_row(r))
            << "pass " << pass << " r0 " << r0 << " it " << it;
        ASSERT_EQ(w::sddmm16_smem_row(r), 32 * (r / 32) + w::sddmm16_smem_row_of_key(r % 32));
      }
    }
  }
}

TEST(CudaLdmatrix, SpmmVTransLoadsTheSparseBFragment) {
  for (int d : {64, 128}) {
    const tile vs{64, d + kPad};
    for (int wn = 0; wn < d / 64; ++wn) {
      for (int kstep = 0; kstep < 2; ++kstep) {
        for (int n = 0; n < 8; ++n) {
          const int c0 = 64 * wn + 8 * n;
          const regs_t got = ldmatrix_x4(vs, [&](int l) {
            const w::smem_coord at = w::ldsm_spmm_b_x4_trans(l);
            return w::smem_coord{32 * kstep + at.row, c0 + at.col};
          }, true);
          for (int lane = 0; lane < 32; ++lane) {
            for (int e = 0; e < 8; ++e) {
              const w::frag_coord c = w::mma_sp_b16_coord(lane, e);  // (k, n)
              ASSERT_EQ(got[lane][e / 2][e % 2], code(32 * kstep + c.row, c0 + c.col))
                  << "d " << d << " wn " << wn << " ks " << kstep << " n " << n << " lane " << lane << " b" << e;
            }
          }
        }
      }
    }
  }
}

// The emulation is not vacuous: a non-transposed load of V, or K's addresses shifted by one lane,
// puts elements in the wrong registers.
TEST(CudaLdmatrix, TheEmulationSeesWrongAddressesAndAMissingTrans) {
  const tile vs{64, 64 + kPad};
  const regs_t plain = ldmatrix_x4(vs, [](int l) { return w::ldsm_spmm_b_x4_trans(l); }, false);
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int e = 0; e < 8; ++e) {
      const w::frag_coord c = w::mma_sp_b16_coord(lane, e);
      wrong += plain[lane][e / 2][e % 2] != code(c.row, c.col);
    }
  }
  EXPECT_GT(wrong, 200);
  const tile ks{64, 64 + kPad};
  const regs_t shifted = ldmatrix_x4(ks, [](int l) { return w::ldsm_sddmm16_b_x4((l + 1) % 32, 0); }, false);
  wrong = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int e = 0; e < 4; ++e) {
      const w::frag_coord c = w::mma_b16_coord(lane, e);
      wrong += shifted[lane][e / 2][e % 2] != code(w::sddmm16_smem_row_of_key(w::sddmm16_key_of_column(c.col)), c.row);
    }
  }
  EXPECT_GT(wrong, 100);
}

}  // namespace
