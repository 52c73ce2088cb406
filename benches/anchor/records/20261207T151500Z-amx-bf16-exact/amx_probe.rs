use std::arch::asm;
use std::time::Instant;
#[repr(C, align(64))] struct Cfg([u8;64]);
#[derive(Clone)] #[repr(C, align(64))] struct Buf([u8; 4096]);
fn main() {
    unsafe { assert_eq!(libc_syscall(), 0); }
    let mut c = [0u8;64]; c[0]=1;
    let cols: u16 = std::env::args().nth(1).map(|a| a.parse().unwrap()).unwrap_or(12);
    for (t,b) in [(0,cols),(1,64),(2,cols),(3,cols),(4,cols),(5,cols)] { c[16+2*t..18+2*t].copy_from_slice(&(b as u16).to_le_bytes()); c[48+t]=16; }
    let cfg = Cfg(c);
    let a = Buf([0x3f;4096]); let bb = Buf([0x3f;4096]);
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr()); }
    let n = 2_000_000u64;
    // (a) tdp only, 4 independent accumulators
    let t = Instant::now();
    for _ in 0..n/4 { unsafe { asm!("tdpbf16ps tmm0, tmm1, tmm2","tdpbf16ps tmm3, tmm1, tmm2","tdpbf16ps tmm4, tmm1, tmm2","tdpbf16ps tmm5, tmm1, tmm2", options(nostack,nomem)); } }
    let e = t.elapsed().as_secs_f64(); println!("tdp only, 4 acc: {:.1} ns each", e*1e9/n as f64);
    let t = Instant::now();
    for _ in 0..n { unsafe { asm!("tdpbf16ps tmm0, tmm1, tmm2", options(nostack,nomem)); } }
    let e = t.elapsed().as_secs_f64(); println!("tdp only, 1 acc chain: {:.1} ns each", e*1e9/n as f64);
    let t = Instant::now();
    for _ in 0..n { unsafe { asm!("tileloadd tmm1, [{a} + {s}]", a=in(reg) a.0.as_ptr(), s=in(reg) 64usize, options(nostack)); } }
    let e = t.elapsed().as_secs_f64(); println!("tileloadd 16x64: {:.1} ns each", e*1e9/n as f64);
    let t = Instant::now();
    for _ in 0..n { unsafe { asm!("tileloadd tmm2, [{a} + {s}]", a=in(reg) bb.0.as_ptr(), s=in(reg) cols as usize, options(nostack)); } }
    let e = t.elapsed().as_secs_f64(); println!("tileloadd 16x{cols} stride {cols}: {:.1} ns each", e*1e9/n as f64);
    let t = Instant::now();
    for i in 0..n { unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) a.0.as_ptr().add((i as usize % 4)*1024 % 3072), s=in(reg) 64usize, b=in(reg) bb.0.as_ptr(), s2=in(reg) cols as usize, options(nostack)); } }
    let e = t.elapsed().as_secs_f64(); println!("load+load+tdp: {:.1} ns each", e*1e9/n as f64);
    let t = Instant::now();
    for _ in 0..n { unsafe { asm!("tdpbssd tmm0, tmm1, tmm2", options(nostack,nomem)); } }
    let e = t.elapsed().as_secs_f64(); println!("tdpbssd chain: {:.1} ns each", e*1e9/n as f64);

    // (c) ring of 6 KiB: store 16 zmm into slot (i+4)%6, tileload slot i%6, tdp
    let mut ring = vec![Buf([0;4096]); 0]; drop(ring);
    let mut r: Vec<Buf> = (0..6).map(|_| Buf([0x3f;4096])).collect();
    for ahead in [1usize, 2, 4, 8, 16, 32] {
    let slots = ahead + 2;
    let mut r: Vec<Buf> = (0..slots).map(|_| Buf([0x3f;4096])).collect();
    let t = Instant::now();
    for i in 0..n as usize/4 {
        let dst = r[(i+ahead)%slots].0.as_mut_ptr();
        unsafe { for k in 0..16 { asm!("vmovdqa64 zmm0, [{s}]", "vmovdqa64 [{d}], zmm0", s=in(reg) a.0.as_ptr().add(64*k), d=in(reg) dst.add(64*k), out("zmm0") _, options(nostack)); } }
        unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) r[i%slots].0.as_ptr(), s=in(reg) 64usize, b=in(reg) bb.0.as_ptr(), s2=in(reg) cols as usize, options(nostack)); }
    }
    let e = t.elapsed().as_secs_f64(); println!("store16+tileload ahead {ahead}: {:.1} ns each", e*1e9/(n/4) as f64);
    }
    let mut sums = Buf([0;4096]);
    let t = Instant::now();
    let mut acc = 0f32;
    for _ in 0..n/16 { unsafe { asm!("tdpbf16ps tmm0, tmm1, tmm2", "tilestored [{s} + {st}], tmm0", s=in(reg) sums.0.as_mut_ptr(), st=in(reg) 64usize, options(nostack)); }
        acc += f32::from_bits(u32::from_le_bytes([sums.0[0],sums.0[1],sums.0[2],sums.0[3]])); }
    let e = t.elapsed().as_secs_f64(); println!("tdp+tilestored+load: {:.1} ns each {acc}", e*1e9/(n/16) as f64);

    {
    let nb = 90usize;
    let parts = vec![0x3fu8; nb*192 + 64];
    let codes = vec![0x35u8; 16*1440];
    let table = Buf([0x3f;4096]);
    let slots = 6usize; let ahead = 4usize;
    let mut r: Vec<Buf> = (0..slots).map(|_| Buf([0x3f;4096])).collect();
    let mut sums = Buf([0;4096]);
    for mode in 0..4 {
    let t = Instant::now();
    let tiles = 2000usize;
    for _ in 0..tiles {
      unsafe { asm!("tilezero tmm0", options(nostack,nomem)); }
      for b in 0..nb {
        if b + ahead < nb {
          let dst = r[(b+ahead)%slots].0.as_mut_ptr();
          for i in 0..16 { unsafe { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vmovdqa64 [{d}], zmm3", s=in(reg) codes.as_ptr().add(i*1440 + 16*(b+ahead)), t=in(reg) table.0.as_ptr(), d=in(reg) dst.add(64*i), out("zmm0") _, out("zmm3") _, options(nostack)); } }
        }
        let bp = if mode & 1 == 1 { parts.as_ptr() } else { unsafe { parts.as_ptr().add(b*192) } };
        let ap = if mode & 2 == 2 { r[0].0.as_ptr() } else { r[b%slots].0.as_ptr() };
        unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) ap, s=in(reg) 64usize, b=in(reg) bp, s2=in(reg) cols as usize, options(nostack)); }
      }
      unsafe { asm!("tilestored [{s} + {st}], tmm0", s=in(reg) sums.0.as_mut_ptr(), st=in(reg) 64usize, options(nostack)); }
    }
    let e = t.elapsed().as_secs_f64(); println!("kernel-like mode {mode} (1: fixed B, 2: fixed A): {:.1} ns per block", e*1e9/(tiles*nb) as f64);
    }
    }

    {
    let nb = 96usize;
    let parts = vec![0x3fu8; nb*192 + 64];
    let codes = vec![0x35u8; 16*1536];
    let table = Buf([0x3f;4096]);
    let mut sums = Buf([0;4096]);
    for group in [1usize, 2, 4, 8] {
    let slots = 2*group;
    let mut r: Vec<Buf> = (0..slots).map(|_| Buf([0x3f;4096])).collect();
    let t = Instant::now();
    let tiles = 2000usize;
    for _ in 0..tiles {
      unsafe { asm!("tilezero tmm0", options(nostack,nomem)); }
      let mut b0 = 0;
      while b0 < nb + group {
        // decode group starting at b0 into slots (b0/group %2)
        if b0 < nb {
          for g in 0..group {
            let b = b0 + g;
            let dst = r[b % slots].0.as_mut_ptr();
            for i in 0..16 { unsafe { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vmovdqa64 [{d}], zmm3", s=in(reg) codes.as_ptr().add(i*1536 + 16*b), t=in(reg) table.0.as_ptr(), d=in(reg) dst.add(64*i), out("zmm0") _, out("zmm3") _, options(nostack)); } }
          }
        }
        // products of the previous group
        if b0 >= group {
          for g in 0..group {
            let b = b0 - group + g;
            unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) r[b%slots].0.as_ptr(), s=in(reg) 64usize, b=in(reg) parts.as_ptr().add(b*192), s2=in(reg) cols as usize, options(nostack)); }
          }
        }
        b0 += group;
      }
      unsafe { asm!("tilestored [{s} + {st}], tmm0", s=in(reg) sums.0.as_mut_ptr(), st=in(reg) 64usize, options(nostack)); }
    }
    let e = t.elapsed().as_secs_f64(); println!("grouped {group}: {:.1} ns per block", e*1e9/(tiles*nb) as f64);
    }
    // decode only
    let mut r: Vec<Buf> = (0..8).map(|_| Buf([0x3f;4096])).collect();
    let t = Instant::now();
    for _ in 0..2000 { for b in 0..nb { let dst = r[b % 8].0.as_mut_ptr();
            for i in 0..16 { unsafe { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vmovdqa64 [{d}], zmm3", s=in(reg) codes.as_ptr().add(i*1536 + 16*b), t=in(reg) table.0.as_ptr(), d=in(reg) dst.add(64*i), out("zmm0") _, out("zmm3") _, options(nostack)); } } } }
    let e = t.elapsed().as_secs_f64(); println!("decode only: {:.1} ns per block", e*1e9/(2000*nb) as f64);
    }

    {
    let n2 = 200_000usize;
    for mode in 0..4 {
      let mut buf = Buf([0x3f;4096]);
      let t = Instant::now();
      for _ in 0..n2 {
        if mode != 0 { unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) a.0.as_ptr(), s=in(reg) 64usize, b=in(reg) bb.0.as_ptr(), s2=in(reg) cols as usize, options(nostack)); } }
        if mode == 1 || mode == 0 { for _ in 0..2 { unsafe { asm!("vpsrlvw zmm0, zmm1, zmm2","vpermw zmm3, zmm1, zmm2","vpsrlvw zmm4, zmm1, zmm2","vpermw zmm5, zmm1, zmm2","vpsrlvw zmm6, zmm1, zmm2","vpermw zmm7, zmm1, zmm2","vpsrlvw zmm8, zmm1, zmm2","vpermw zmm9, zmm1, zmm2","vpsrlvw zmm10, zmm1, zmm2","vpermw zmm11, zmm1, zmm2","vpsrlvw zmm12, zmm1, zmm2","vpermw zmm13, zmm1, zmm2","vpsrlvw zmm14, zmm1, zmm2","vpermw zmm15, zmm1, zmm2","vpsrlvw zmm16, zmm1, zmm2","vpermw zmm17, zmm1, zmm2", out("zmm0") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, options(nostack,nomem)); } } }
        if mode == 3 { for i in 0..16 { unsafe { asm!("vmovdqa64 [{d}], zmm1", d=in(reg) buf.0.as_mut_ptr().add(2048 + 64*(i%16)), options(nostack)); } } }
      }
      let e = t.elapsed().as_secs_f64(); println!("overlap mode {mode} (0 alu only, 1 amx+alu, 2 amx only, 3 amx+16 stores elsewhere): {:.1} ns", e*1e9/n2 as f64);
    }
    }

    {
    let nb = 96usize;
    let parts = vec![0x3fu8; nb*192 + 64];
    let codes = vec![0x35u8; 16*1536];
    let table = Buf([0x3f;4096]);
    let clean: Vec<Buf> = (0..6).map(|_| Buf([0x3f;4096])).collect();
    let mut sums = Buf([0;4096]);
    let slots = 6usize; let ahead = 4usize;
    let mut r: Vec<Buf> = (0..slots).map(|_| Buf([0x3f;4096])).collect();
    for mode in 0..3 {
    let t = Instant::now();
    let tiles = 2000usize;
    for _ in 0..tiles {
      unsafe { asm!("tilezero tmm0", options(nostack,nomem)); }
      for b in 0..nb {
        if b + ahead < nb {
          let dst = r[(b+ahead)%slots].0.as_mut_ptr();
          if mode == 2 {
          for i in 0..16 { unsafe { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vpxord zmm4, zmm4, zmm3", s=in(reg) codes.as_ptr().add(i*1536 + 16*(b+ahead)), t=in(reg) table.0.as_ptr(), out("zmm0") _, out("zmm3") _, out("zmm4") _, options(nostack)); } }
          } else {
          for i in 0..16 { unsafe { asm!("vbroadcasti32x4 zmm0, [{s}]", "vpsrlvw zmm0, zmm0, zmm2","vpermw zmm3, zmm0, [{t}]", "vmovdqa64 [{d}], zmm3", s=in(reg) codes.as_ptr().add(i*1536 + 16*(b+ahead)), t=in(reg) table.0.as_ptr(), d=in(reg) dst.add(64*i), out("zmm0") _, out("zmm3") _, options(nostack)); } }
          }
        }
        let ap = if mode >= 1 { clean[b%6].0.as_ptr() } else { r[b%slots].0.as_ptr() };
        unsafe { asm!("tileloadd tmm1, [{a} + {s}]","tileloadd tmm2, [{b} + {s2}]","tdpbf16ps tmm0, tmm1, tmm2", a=in(reg) ap, s=in(reg) 64usize, b=in(reg) parts.as_ptr().add(b*192), s2=in(reg) cols as usize, options(nostack)); }
      }
      unsafe { asm!("tilestored [{s} + {st}], tmm0", s=in(reg) sums.0.as_mut_ptr(), st=in(reg) 64usize, options(nostack)); }
    }
    let e = t.elapsed().as_secs_f64(); println!("mode {mode} (0 ring read, 1 tiles read clean buffers, 2 no stores): {:.1} ns per block", e*1e9/(tiles*nb) as f64);
    }
    }
    unsafe { asm!("tilerelease"); }
}
unsafe fn libc_syscall() -> i64 { let r: i64; unsafe { asm!("syscall", inlateout("rax") 158i64 => r, in("rdi") 0x1023i64, in("rsi") 18i64, lateout("rcx") _, lateout("r11") _); } r }
