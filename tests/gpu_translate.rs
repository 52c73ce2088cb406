//! Every WGSL kernel, in every variant, translated with naga (the same version wgpu uses)
//! to SPIR-V (Vulkan), MSL (Metal) and HLSL (DX12), failing on any parse, validation or
//! translation error. Metal and DX12 cannot run here; this is what guards them. Needs no GPU.

use naga::back::{hlsl, msl, spv};
use naga::valid::{Capabilities, ValidationFlags, Validator};
use picchio::backend::gpu::shaders::{Op, all_variants, source};

#[test]
fn every_shader_variant_translates_to_spirv_msl_and_hlsl() {
    let variants = all_variants();
    let mut failures = Vec::new();
    for &(op, v) in &variants {
        let name = format!("{} [{}]", op.file(), v.label());
        let src = source(op, v).unwrap();
        let module = match naga::front::wgsl::parse_str(&src) {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{name}: WGSL parse: {}", e.emit_to_string(&src)));
                continue;
            }
        };
        let mut caps = Capabilities::empty();
        if v.f16 {
            caps |= Capabilities::SHADER_FLOAT16 | Capabilities::SHADER_FLOAT16_IN_FLOAT32;
        }
        if v.subgroup {
            caps |= Capabilities::SUBGROUP;
        }
        let info = match Validator::new(ValidationFlags::all(), caps).validate(&module) {
            Ok(i) => i,
            Err(e) => {
                failures.push(format!("{name}: validation: {}", e.emit_to_string(&src)));
                continue;
            }
        };
        let spv_opts = spv::Options { lang_version: (1, 3), ..Default::default() };
        if let Err(e) = spv::write_vec(&module, &info, &spv_opts, None) {
            failures.push(format!("{name}: SPIR-V: {e}"));
        }
        let msl_opts = msl::Options { lang_version: (2, 4), ..Default::default() };
        let msl_pipe = msl::PipelineOptions::default();
        if let Err(e) = msl::write_string(&module, &info, &msl_opts, &msl_pipe) {
            failures.push(format!("{name}: MSL: {e}"));
        }
        let hlsl_opts = hlsl::Options { shader_model: hlsl::ShaderModel::V6_2, ..Default::default() };
        let hlsl_pipe = hlsl::PipelineOptions::default();
        let mut out = String::new();
        if let Err(e) = hlsl::Writer::new(&mut out, &hlsl_opts, &hlsl_pipe).write(&module, &info, None) {
            failures.push(format!("{name}: HLSL: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
    );
    // Every op is covered, in its portable build and (at least) its SUBGROUP build.
    for op in Op::ALL {
        assert!(variants.iter().any(|(o, v)| *o == op && !v.subgroup && !v.f16));
        assert!(variants.iter().any(|(o, v)| *o == op && v.subgroup));
    }
    eprintln!("{} shader variants translated to SPIR-V, MSL and HLSL", variants.len());
}
