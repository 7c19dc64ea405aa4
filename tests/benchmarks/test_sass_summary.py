"""benchmarks/sass_summary.py: per-kernel opcode counts of a cuobjdump SASS listing (predicates and modifiers stripped)."""

LISTING = """
        Function : _ZN4loco12_GLOBAL__N_111hop1_kernelILi2ELi4ELi8ELb0EEEvNS0_6LaunchE
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   I2F.S8 R2, R3 ;                        /* 0x0000000300027306 */
        /*0020*/              @!P0 SHFL.BFLY PT, R4, R5, 0x1, 0x1f ;      /* 0x0c201f0005047f89 */
        /*0030*/                   STL [R1], R2 ;                         /* 0x0000000201007387 */
        Function : _ZN4loco12_GLOBAL__N_111hop2_kernelILi4ELi8EEEvNS0_6LaunchEi
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0010*/               @P1 FADD R0, R1, R2 ;                      /* 0x0000000201007221 */
"""


def test_counts_opcodes_per_kernel(benchmark_module):
    sass = benchmark_module("sass_summary")
    kernels = sass.summarize(LISTING.splitlines())
    hop1 = kernels["_ZN4loco12_GLOBAL__N_111hop1_kernelILi2ELi4ELi8ELb0EEEvNS0_6LaunchE"]
    hop2 = kernels["_ZN4loco12_GLOBAL__N_111hop2_kernelILi4ELi8EEEvNS0_6LaunchEi"]
    assert hop1 == {"LDC": 1, "I2F": 1, "SHFL": 1, "STL": 1}
    assert hop2 == {"BAR": 1, "FADD": 1}
