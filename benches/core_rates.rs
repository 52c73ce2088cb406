//! What one core does per unit of time with 512-bit vectors, for kernel design: independent
//! fused multiply-adds on registers, loads from L1, and multiply-adds that take their second
//! operand from L1 (the form the batched kernels' inner loops have). Prints each as operations
//! a nanosecond and as operations per multiply-add slot: a kernel whose loads a nanosecond
//! exceed what `loads` shows is bound by loads, not by its multiply-adds.
//!
//! ```sh
//! cargo bench --bench core_rates
//! ```
//!
//! x86-64 with AVX-512 F only (the loops are written out in assembly so that the compiler
//! cannot change what they measure); elsewhere it says so and exits.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    /// Bytes a block of the memory loops advances in each of its eight streams: one
    /// MXFP4 block of 32 inputs as f32.
    const BLOCK_BYTES: usize = 128;

    /// Assembly that zeroes `zmm0` to `zmm17` (the accumulators and multiplicands of the loops
    /// below), so that no loop starts from a leftover value that is subnormal.
    macro_rules! zero_registers {
        () => {
            "vxorps xmm0, xmm0, xmm0\nvxorps xmm1, xmm1, xmm1\nvxorps xmm2, xmm2, xmm2\n\
             vxorps xmm3, xmm3, xmm3\nvxorps xmm4, xmm4, xmm4\nvxorps xmm5, xmm5, xmm5\n\
             vxorps xmm6, xmm6, xmm6\nvxorps xmm7, xmm7, xmm7\nvxorps xmm8, xmm8, xmm8\n\
             vxorps xmm9, xmm9, xmm9\nvxorps xmm10, xmm10, xmm10\nvxorps xmm11, xmm11, xmm11\n\
             vxorps xmm12, xmm12, xmm12\nvxorps xmm13, xmm13, xmm13\nvxorps xmm14, xmm14, xmm14\n\
             vxorps xmm15, xmm15, xmm15\nvxorps xmm16, xmm16, xmm16\nvxorps xmm17, xmm17, xmm17"
        };
    }

    /// 16 independent multiply-add chains on registers, `iters` times.
    #[target_feature(enable = "avx512f")]
    fn fma_registers(iters: u64) {
        // SAFETY: registers only.
        unsafe {
            asm!(
                zero_registers!(),
                "2:",
                "vfmadd231ps zmm0, zmm16, zmm17", "vfmadd231ps zmm1, zmm16, zmm17",
                "vfmadd231ps zmm2, zmm16, zmm17", "vfmadd231ps zmm3, zmm16, zmm17",
                "vfmadd231ps zmm4, zmm16, zmm17", "vfmadd231ps zmm5, zmm16, zmm17",
                "vfmadd231ps zmm6, zmm16, zmm17", "vfmadd231ps zmm7, zmm16, zmm17",
                "vfmadd231ps zmm8, zmm16, zmm17", "vfmadd231ps zmm9, zmm16, zmm17",
                "vfmadd231ps zmm10, zmm16, zmm17", "vfmadd231ps zmm11, zmm16, zmm17",
                "vfmadd231ps zmm12, zmm16, zmm17", "vfmadd231ps zmm13, zmm16, zmm17",
                "vfmadd231ps zmm14, zmm16, zmm17", "vfmadd231ps zmm15, zmm16, zmm17",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                out("zmm16") _, out("zmm17") _,
                options(nostack, nomem),
            );
        }
    }

    /// A loop over `blocks` blocks of eight streams (`p`, each readable for `blocks *
    /// BLOCK_BYTES` bytes): two 512-bit operations a stream and block, `$op` (a mnemonic)
    /// into 16 different registers, after `$operand` (a register operand, or nothing) and
    /// before the memory operand.
    macro_rules! stream_loop {
        ($name:ident, $op:literal, $operand:literal) => {
            #[target_feature(enable = "avx512f")]
            fn $name(p: &[*const u8; 8], blocks: usize) {
                // One past the end of each stream, and a negative byte index counting up to 0.
                // SAFETY: one past the end of what the caller allocated.
                let e: [*const u8; 8] = std::array::from_fn(|t| unsafe { p[t].add(blocks * BLOCK_BYTES) });
                let j = -((blocks * BLOCK_BYTES) as isize);
                // SAFETY: reads `blocks * BLOCK_BYTES` bytes of each stream; writes registers.
                unsafe {
                    asm!(
                        zero_registers!(),
                        "2:",
                        concat!($op, " zmm0, ", $operand, "zmmword ptr [{p0} + {j}]"),
                        concat!($op, " zmm1, ", $operand, "zmmword ptr [{p0} + {j} + 64]"),
                        concat!($op, " zmm2, ", $operand, "zmmword ptr [{p1} + {j}]"),
                        concat!($op, " zmm3, ", $operand, "zmmword ptr [{p1} + {j} + 64]"),
                        concat!($op, " zmm4, ", $operand, "zmmword ptr [{p2} + {j}]"),
                        concat!($op, " zmm5, ", $operand, "zmmword ptr [{p2} + {j} + 64]"),
                        concat!($op, " zmm6, ", $operand, "zmmword ptr [{p3} + {j}]"),
                        concat!($op, " zmm7, ", $operand, "zmmword ptr [{p3} + {j} + 64]"),
                        concat!($op, " zmm8, ", $operand, "zmmword ptr [{p4} + {j}]"),
                        concat!($op, " zmm9, ", $operand, "zmmword ptr [{p4} + {j} + 64]"),
                        concat!($op, " zmm10, ", $operand, "zmmword ptr [{p5} + {j}]"),
                        concat!($op, " zmm11, ", $operand, "zmmword ptr [{p5} + {j} + 64]"),
                        concat!($op, " zmm12, ", $operand, "zmmword ptr [{p6} + {j}]"),
                        concat!($op, " zmm13, ", $operand, "zmmword ptr [{p6} + {j} + 64]"),
                        concat!($op, " zmm14, ", $operand, "zmmword ptr [{p7} + {j}]"),
                        concat!($op, " zmm15, ", $operand, "zmmword ptr [{p7} + {j} + 64]"),
                        "add {j}, 128",
                        "jnz 2b",
                        j = inout(reg) j => _,
                        p0 = in(reg) e[0], p1 = in(reg) e[1], p2 = in(reg) e[2], p3 = in(reg) e[3],
                        p4 = in(reg) e[4], p5 = in(reg) e[5], p6 = in(reg) e[6], p7 = in(reg) e[7],
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                        out("zmm16") _, out("zmm17") _,
                        options(nostack, readonly),
                    );
                }
            }
        };
    }

    stream_loop!(loads, "vmovups", "");
    stream_loop!(fma_from_memory, "vfmadd231ps", "zmm16, ");

    /// Best of `tries` timings of `f`, in nanoseconds a repetition over `ops` operations.
    fn ns_per_op(tries: usize, ops: u64, mut f: impl FnMut()) -> f64 {
        (0..tries)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e9 / ops as f64
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Runs the three loops and prints their rates.
    pub fn run() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            println!("core_rates: this CPU has no AVX-512 F; nothing measured");
            return;
        }
        const ITERS: u64 = 20_000_000;
        // SAFETY (all calls): the CPU has AVX-512 F (checked above).
        let fma = ns_per_op(5, 16 * ITERS, || unsafe { fma_registers(ITERS) });
        println!("512-bit multiply-adds on registers (16 chains): {:.2} a ns", 1.0 / fma);
        // Eight streams 11 520 bytes apart (rows of 2880 f32, as the kernels' inputs are),
        // `blocks` blocks each, repeated: 16 and 32 blocks stay in L1, 90 do not.
        let stride = 2880 * 4;
        let buf = vec![1.0f32; (8 * stride + 90 * BLOCK_BYTES) / 4];
        let base = buf.as_ptr().cast::<u8>();
        // SAFETY: every stream start leaves 90 blocks inside `buf`.
        let p: [*const u8; 8] = std::array::from_fn(|t| unsafe { base.add(t * stride) });
        for blocks in [16usize, 32, 90] {
            let reps = 4 * ITERS / blocks as u64;
            let ops = reps * blocks as u64 * 16;
            let load = ns_per_op(5, ops, || (0..reps).for_each(|_| unsafe { loads(&p, blocks) }));
            let mem = ns_per_op(5, ops, || (0..reps).for_each(|_| unsafe { fma_from_memory(&p, blocks) }));
            println!(
                "{blocks:>2} blocks of 8 streams: 512-bit loads {:.2} a ns ({:.2} a multiply-add slot), \
                 multiply-adds from memory {:.2} a ns ({:.2} a slot)",
                1.0 / load,
                fma / load,
                1.0 / mem,
                fma / mem
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("core_rates: x86-64 only; nothing measured");
}
