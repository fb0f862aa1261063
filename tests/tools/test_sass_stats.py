"""tools/cuda/sass_stats.py's parsing and counting on a hand-written SASS listing (no cuobjdump
needed): the loop found, padding dropped, tensor core instructions counted, the per-tile rule."""
import importlib.util
import os
import sys
import unittest

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("sass_stats", os.path.join(here, "..", "..", "tools", "cuda", "sass_stats.py"))
sass = importlib.util.module_from_spec(spec)
sys.modules["sass_stats"] = sass  # dataclasses look their module up there
spec.loader.exec_module(sass)


def listing(ops):
    lines = ["\tcode for sm_90", "\t\tFunction : _Z11spmm_kernelI6__halfLi64EEvv"]
    for i, op in enumerate(ops):
        lines.append(f"        /*{i * 16:04x}*/                   {op} ;   /* 0x0 */")
        lines.append("                                                  /* 0x0 */")
    return "\n".join(lines)


class SassStats(unittest.TestCase):
    def test_counts(self):
        ops = ["S2R R0, SR_TID.X", "MOV R1, RZ",  # 0x00, 0x10: prologue
               "LDS R2, [R0]", "@!P0 BRA 0x20",  # 0x20, 0x30: a copy loop before the main loop
               "HMMA.SP.16832.F32 R4, R2, R2, R4", "HMMA.16816.F32 R8, R2, R2, R8",  # 0x40, 0x50
               "LDS R3, [R0]", "@!P1 BRA 0x60",  # 0x60, 0x70: a loop nested in the main loop
               "@P0 BRA 0x40",  # 0x80: the main loop [0x40, 0x80]
               "EXIT", "BRA 0xa0", "NOP", "NOP"]  # 0x90, 0xa0 (self-branch), padding
        (f,) = sass.parse(listing(ops))
        self.assertEqual(f.arch, "sm_90")
        self.assertEqual(len(f.ops), 10)  # padding and the self-branch dropped
        st = sass.stats(f, "spmm_kernel")
        self.assertEqual((st["total"], st["mma"], st["mma_sparse"]), (10, 2, 1))
        self.assertEqual(st["loop"], 5)  # 0x40 .. 0x80, the nested loop counted once
        self.assertEqual(st["per_tile"], 2.5)  # spmm: half a 64-key step per 32 x 32 tile
        st = sass.stats(f, "sddmm_select_kernel", "bf16, 4, 2:4")
        self.assertEqual(st["per_tile"], 5)  # the first main loop (2 HMMA = one tile of D = 4)
        st = sass.stats(f, "sddmm_select_kernel", "bf16, 8, 2:4")
        self.assertEqual(st["per_tile"], 10)  # a tile of D = 8 needs 4 HMMA: twice this loop
        self.assertIsNone(sass.stats(f, "sddmm_select_kernel", "bf16")["per_tile"])

    def test_first_loop(self):
        ops = ["S2R R0, SR_TID.X",  # 0x00
               "HMMA.16816.F32 R8, R2, R2, R8", "@P0 BRA 0x10",  # 0x10, 0x20: steady-state loop
               "LDS R3, [R0]", "HMMA.16816.F32 R8, R2, R2, R8", "FSEL R1, R1, R2, P1", "@P1 BRA 0x30",  # 0x30..0x60
               "EXIT"]
        (f,) = sass.parse(listing(ops))
        self.assertEqual(sass.stats(f, "sddmm_select_kernel", "bf16, 2, 2:4")["per_tile"], 2)  # only the first loop
        self.assertEqual(sass.stats(f, "spmm_kernel")["loop"], 6)  # every loop holding MMA

    def test_names(self):
        base, args = sass.short_name(
            "void dfss::cuda::(anonymous namespace)::sddmm_select_kernel<__nv_bfloat16, 64, "
            "(dfss::cuda::warp::sp_pattern)1>(dfss::cuda::pipeline_args)")
        self.assertEqual((base, args), ("sddmm_select_kernel", "bf16, 64, 1:2"))  # sp_pattern::p1of2 == 1


if __name__ == "__main__":
    sys.exit(unittest.main())
