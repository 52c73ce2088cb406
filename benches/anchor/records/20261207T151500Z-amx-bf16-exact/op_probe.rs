use std::arch::asm;
use std::time::Instant;
#[repr(C, align(64))] struct Buf([u8; 16384]);
fn main() {
    let a = Buf([0x3f;16384]); let mut o = Buf([0;16384]);
    let n = 20_000_000usize;
    for (name, which) in [("vpsrlvw", 0), ("vpermw", 1), ("vpsrlvw+vpermw(mem)", 2), ("bcast+srlv+permw+store", 3), ("vpmultishiftqb", 4), ("vpermb", 5)] {
        let t = Instant::now();
        for i in 0..n/8 {
            unsafe { match which {
              0 => asm!("vpsrlvw zmm0, zmm1, zmm2","vpsrlvw zmm3, zmm1, zmm2","vpsrlvw zmm4, zmm1, zmm2","vpsrlvw zmm5, zmm1, zmm2","vpsrlvw zmm6, zmm1, zmm2","vpsrlvw zmm7, zmm1, zmm2","vpsrlvw zmm8, zmm1, zmm2","vpsrlvw zmm9, zmm1, zmm2", out("zmm0") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, options(nostack,nomem)),
              1 => asm!("vpermw zmm0, zmm1, zmm2","vpermw zmm3, zmm1, zmm2","vpermw zmm4, zmm1, zmm2","vpermw zmm5, zmm1, zmm2","vpermw zmm6, zmm1, zmm2","vpermw zmm7, zmm1, zmm2","vpermw zmm8, zmm1, zmm2","vpermw zmm9, zmm1, zmm2", out("zmm0") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, options(nostack,nomem)),
              2 => { for k in 0..8 { asm!("vpsrlvw zmm0, zmm1, zmm2","vpermw zmm3, zmm0, [{t}]", t=in(reg) a.0.as_ptr().add(64*k), out("zmm0") _, out("zmm3") _, options(nostack)); } },
              3 => { for k in 0..8 { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vmovdqa64 [{d}], zmm3", s=in(reg) a.0.as_ptr().add(16*((i*8+k)%512)), t=in(reg) a.0.as_ptr().add(64*k), d=in(reg) o.0.as_mut_ptr().add(64*((i*8+k)%64)), out("zmm0") _, out("zmm3") _, options(nostack)); } },
              4 => asm!("vpmultishiftqb zmm0, zmm1, zmm2","vpmultishiftqb zmm3, zmm1, zmm2","vpmultishiftqb zmm4, zmm1, zmm2","vpmultishiftqb zmm5, zmm1, zmm2","vpmultishiftqb zmm6, zmm1, zmm2","vpmultishiftqb zmm7, zmm1, zmm2","vpmultishiftqb zmm8, zmm1, zmm2","vpmultishiftqb zmm9, zmm1, zmm2", out("zmm0") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, options(nostack,nomem)),
              _ => asm!("vpermb zmm0, zmm1, zmm2","vpermb zmm3, zmm1, zmm2","vpermb zmm4, zmm1, zmm2","vpermb zmm5, zmm1, zmm2","vpermb zmm6, zmm1, zmm2","vpermb zmm7, zmm1, zmm2","vpermb zmm8, zmm1, zmm2","vpermb zmm9, zmm1, zmm2", out("zmm0") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, options(nostack,nomem)),
            } }
        }
        let e = t.elapsed().as_secs_f64(); println!("{name}: {:.2} ns each, {:.2} cycles at 3.45", e*1e9/n as f64, e*1e9/n as f64*3.45);
    }
}
