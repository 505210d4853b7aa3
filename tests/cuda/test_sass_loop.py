"""tools/sass_loop.py: the hot loop of a kernel's SASS, counted by opcode (no GPU needed)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("sass_loop", Path(__file__).resolve().parents[2] / "tools" / "sass_loop.py")
sass_loop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_loop)

# cuobjdump -sass output: a short loop (0x0030 .. 0x0070), a longer one (0x0090 .. 0x00f0), a never-taken
# backward branch that spans both, and a forward branch
SASS = """
        Function : k
        .headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                 /* 0x000fe40000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;          /* 0x000000100000780c */
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;                      /* 0x0000000102027810 */
        /*0040*/                   PRMT R3, R4, 0x5410, R5 ;                    /* 0x0000541004037816 */
        /*0050*/                   ISETP.NE.AND P1, PT, R2, 0x8, PT ;           /* 0x000000080200780c */
        /*0060*/               @P0 BRA 0xa0 ;                                   /* 0x0000000000000947 */
        /*0070*/               @P1 BRA 0x30 ;                                   /* 0x0000000000001947 */
        /*0080*/                   MOV R6, RZ ;                                 /* 0x000000ff00067202 */
        /*0090*/                   LDS.128 R8, [R6] ;                           /* 0x0000000006087984 */
        /*00a0*/                   PRMT R12, R8, 0x7362, R9 ;                   /* 0x0000736208 0c7816 */
        /*00b0*/                   HMUL2.BF16_V2 R12, R12, R13 ;                /* 0x0000000d0c0c7232 */
        /*00c0*/                   PRMT R14, R10, 0x5140, R11 ;                 /* 0x000051400a0e7816 */
        /*00d0*/                   @!P2 LDGSTS.E.BYPASS.128 [R15], desc[UR4][R16.64] ;  /* 0x00000000100f7fae */
        /*00e0*/                   ISETP.NE.AND P2, PT, R6, 0x40, PT ;          /* 0x000000400600780c */
        /*00f0*/               @P2 BRA 0x90 ;                                   /* 0x0000000000002947 */
        /*0100*/              @!PT BRA 0x0 ;                                    /* 0x0000000000008947 */
        /*0110*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def test_parse_and_opcodes():
    ins = sass_loop.parse_sass(SASS)
    assert len(ins) == 18 and ins[0] == (0x0, "LDC R1, c[0x0][0x28]") and ins[-1] == (0x110, "EXIT")
    assert sass_loop.opcode("@!P2 LDGSTS.E.BYPASS.128 [R15], desc[UR4][R16.64]") == "LDGSTS"
    assert sass_loop.opcode("HMUL2.BF16_V2 R12, R12, R13") == "HMUL2"


def test_hot_loop_is_the_longest_taken_backward_branch():
    loop = sass_loop.hot_loop(sass_loop.parse_sass(SASS))
    assert [a for a, _ in loop] == list(range(0x90, 0x100, 0x10))  # not 0x30..0x70, not the @!PT one
    assert sass_loop.histogram(loop) == {"PRMT": 2, "LDS": 1, "HMUL2": 1, "LDGSTS": 1, "ISETP": 1, "BRA": 1}
    assert sass_loop.hot_loop(sass_loop.parse_sass(SASS.split("/*0030*/")[0])) == []  # no loop at all


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cuobjdump")), reason="needs nvcc and cuobjdump")
def test_the_wgmma_engine_loop():
    """The wgmma engine's k block, built as the backend builds it: its 8 wgmma of 64 k and the
    dequantization's 32 bf16 multiplies (8 words of 8 nibbles a thread)."""
    counts = sass_loop.histogram(sass_loop.hot_loop(sass_loop.parse_sass(
        sass_loop.build_sass("gemm_nvfp4.cu", "nvfp4_gemm_sorted_glu_m128wgk64", "sm_90a"))))
    assert counts["HGMMA"] == 8 and counts["HMUL2"] == 32, counts
