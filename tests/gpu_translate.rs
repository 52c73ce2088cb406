//! Every WGSL kernel, in every variant (the F16 key/value cache's KV_F16 included), translated with naga (the same version wgpu uses)
//! to SPIR-V (Vulkan), MSL (Metal) and HLSL (DX12), failing on any parse, validation or
//! translation error, and on an HLSL entry-point input without a semantic (naga writes one
//! without error, DXC refuses it; no HLSL compiler runs here). Metal and DX12 cannot run
//! here; this is what guards them. Needs no GPU.

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
        if v.kv_f16 {
            // pack2x16float / unpack2x16float: wgpu grants this wherever the adapter has the
            // downlevel flag SHADER_F16_IN_F32 (the backend refuses an F16 cache elsewhere).
            caps |= Capabilities::SHADER_FLOAT16_IN_FLOAT32;
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
        match hlsl::Writer::new(&mut out, &hlsl_opts, &hlsl_pipe).write(&module, &info, None) {
            Err(e) => failures.push(format!("{name}: HLSL: {e}")),
            Ok(reflection) => {
                for ep in reflection.entry_point_names {
                    match ep {
                        Ok(ep) => {
                            for problem in inputs_without_semantics(&out, &ep) {
                                failures.push(format!("{name}: HLSL entry point {ep}: {problem}"));
                            }
                        }
                        Err(e) => failures.push(format!("{name}: HLSL entry point: {e}")),
                    }
                }
            }
        }
    }
    let failed: std::collections::BTreeSet<&str> =
        failures.iter().filter_map(|f| f.split(": ").next()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failed.len(),
        variants.len(),
        failures.join("\n")
    );
    // Every op is covered, in its portable build and (at least) its SUBGROUP build.
    for op in Op::ALL {
        assert!(variants.iter().any(|(o, v)| *o == op && !v.subgroup && !v.f16 && !v.kv_f16));
        assert!(variants.iter().any(|(o, v)| *o == op && v.subgroup));
    }
    // The key/value cache's kernels, with an F16 cache, portable and SUBGROUP builds.
    for op in [Op::KvStore, Op::Attention, Op::AttentionDecode] {
        for subgroup in [false, true] {
            assert!(variants.iter().any(|(o, v)| *o == op && v.kv_f16 && v.subgroup == subgroup));
        }
    }
    assert!(variants.iter().all(|(o, v)| !v.kv_f16 || o.uses_kv_cache()));
    eprintln!("{} shader variants translated to SPIR-V, MSL and HLSL", variants.len());
}

/// The inputs of the HLSL entry point `ep` in `hlsl` (naga's output) that have no semantic:
/// a parameter without one, or a member of a struct parameter without one. DXC refuses such
/// an entry point ("Semantic must be defined for all parameters of an entry function"), so
/// naga translating without error is not enough. An empty list when every input has one.
fn inputs_without_semantics(hlsl: &str, ep: &str) -> Vec<String> {
    let Some(start) = hlsl.find(&format!("void {ep}(")) else {
        return vec![format!("no `void {ep}(` in the output")];
    };
    let args_start = start + "void (".len() + ep.len();
    let Some(len) = hlsl[args_start..].find(')') else {
        return vec![format!("unterminated parameter list of {ep}")];
    };
    let mut problems = Vec::new();
    for param in hlsl[args_start..args_start + len].split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if param.contains(':') {
            continue;
        }
        // `Type name`: without a semantic the type must be a struct whose members all have one.
        let ty = param.split_whitespace().next().unwrap_or(param);
        match struct_members(hlsl, ty) {
            Some(members) => problems.extend(
                members
                    .into_iter()
                    .filter(|m| !m.contains(':'))
                    .map(|m| format!("member `{m}` of `{ty}` has no semantic")),
            ),
            None => problems.push(format!("parameter `{param}` has no semantic")),
        }
    }
    problems
}

/// The member declarations (without the `;`) of `struct name { ... };` in `hlsl`.
fn struct_members(hlsl: &str, name: &str) -> Option<Vec<String>> {
    let start = hlsl.find(&format!("struct {name} {{"))?;
    let body = &hlsl[start..];
    let open = body.find('{')? + 1;
    let close = body.find("};")?;
    Some(body[open..close].split(';').map(str::trim).filter(|m| !m.is_empty()).map(String::from).collect())
}

#[test]
fn the_semantics_check_finds_missing_semantics() {
    let ok = "struct In {\n    uint lid : SV_GroupIndex;\n};\n\n[numthreads(64, 1, 1)]\nvoid main(In in_, uint3 wid : SV_GroupID)\n{\n}\n";
    assert!(inputs_without_semantics(ok, "main").is_empty());
    let bad = "struct Ids {\n    uint lid : SV_GroupIndex;\n    uint sg_lane;\n};\n\nvoid main(Ids ids, uint x)\n{\n}\n";
    assert_eq!(
        inputs_without_semantics(bad, "main"),
        ["member `uint sg_lane` of `Ids` has no semantic", "parameter `uint x` has no semantic"]
    );
    assert_eq!(inputs_without_semantics(ok, "other"), ["no `void other(` in the output"]);
}
