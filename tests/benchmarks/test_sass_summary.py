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


SOURCE_CSV = """\
"hop1_kernel<2, 4, 0, 0>(Launch)"
"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed"
"0","LDC R1, c[0x0][0x28]","3","65,536","2,097,152"
"10","@!P0 FFMA R2, R3, R4, R5","10","131072","4194304"
"20","FFMA R6, R3, R4, R5","1","1000","32000"
"hop1_kernel<2, 4, 8, 0>(Launch)"
"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed"
"0","SHFL.BFLY PT, R4, R5, 0x1, 0x1f","0","7","224"
"""


def test_ncu_source_page_totals_per_kernel_and_opcode(benchmark_module):
    sass = benchmark_module("sass_summary")
    sections = sass.summarize_source(SOURCE_CSV.splitlines())
    assert [title for title, _ in sections] == ["hop1_kernel<2, 4, 0, 0>(Launch)", "hop1_kernel<2, 4, 8, 0>(Launch)"]
    assert sections[0][1] == [(65536, "LDC R1, c[0x0][0x28]"), (131072, "@!P0 FFMA R2, R3, R4, R5"),
                              (1000, "FFMA R6, R3, R4, R5")]
    assert sections[1][1] == [(7, "SHFL.BFLY PT, R4, R5, 0x1, 0x1f")]


PATHS = """
        Function : _ZN4loco12_GLOBAL__N_111hop2_kernelILi4ELi8EEEvNS0_6LaunchEi
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
        Function : _ZN4loco12_GLOBAL__N_111hop1_kernelILi2ELi4ELi8ELb0EEEvNS0_6LaunchE
        /*0000*/                   ISETP.NE.AND P0, PT, R6, 0x1, PT ;     /* 0x0000000106007c0c */
        /*0010*/              @!P0 BRA 0x40 ;                             /* 0x0000000000088947 */
        /*0020*/                   FADD R0, R1, R2 ;                      /* 0x0000000201007221 */
        /*0030*/                   BRA 0x50 ;                             /* 0x0000000000047947 */
        /*0040*/                   FMUL R0, R1, R2 ;                      /* 0x0000000201007220 */
        /*0050*/               @P1 BRA 0x10 ;                             /* 0x0000000000f41947 */
        /*0060*/               @P2 EXIT ;                                 /* 0x000000000000294d */
        /*0070*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_path_follows_the_given_branches_and_stops_at_exit(benchmark_module):
    """The walk takes the listed conditional branches and every unconditional one, falls through the others (a
    predicated EXIT does not end it) and names each conditional branch it met with its decision."""
    sass = benchmark_module("sass_summary")
    code = sass.kernel_instructions(PATHS.splitlines(), "hop1_kernel")
    assert [address for address, _ in code] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    ops, branches = sass.walk(code, taken=set())
    assert ops == {"ISETP": 1, "BRA": 3, "FADD": 1, "EXIT": 2}
    assert [(a, follow) for a, _, follow in branches] == [(0x10, False), (0x50, False)]
    ops, branches = sass.walk(code, taken={0x10})
    assert ops == {"ISETP": 1, "BRA": 2, "FMUL": 1, "EXIT": 2}
    assert [(a, follow) for a, _, follow in branches] == [(0x10, True), (0x50, False)]


def test_path_stops_a_loop_whose_exit_is_not_taken_at_the_limit(benchmark_module):
    sass = benchmark_module("sass_summary")
    code = sass.kernel_instructions(PATHS.splitlines(), "hop1_kernel")
    ops, _ = sass.walk(code, taken={0x50}, limit=50)
    assert sum(ops.values()) == 50
