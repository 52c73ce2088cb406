//! `picchio devices`: the GPU adapters wgpu finds, with what Picchio needs to know about
//! each (backend, type, driver, memory, limits, optional features) and which one
//! `--device auto` and `--device gpu` would take.

use clap::Args;
use picchio::backend::gpu::{GpuApi, list_adapters};
use picchio::system::gib;

/// Arguments of `picchio devices`.
#[derive(Args, Debug)]
pub struct DevicesArgs {
    /// Only adapters of this graphics API (default: `WGPU_BACKEND`, else all).
    #[arg(long, value_enum)]
    gpu_backend: Option<GpuApi>,
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// Runs `picchio devices`.
pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let adapters = list_adapters(args.gpu_backend);
    if adapters.is_empty() {
        println!(
            "no GPU adapter with compute shaders found (backends: {:?}); Picchio runs on the CPU",
            picchio::backend::gpu::device::backends(args.gpu_backend)
        );
        return Ok(());
    }
    let auto = adapters.iter().position(|a| !a.is_software());
    for (i, a) in adapters.iter().enumerate() {
        let l = &a.limits;
        println!("[{i}] {}", a.name);
        println!(
            "    backend {:?}, type {:?}{}",
            a.backend,
            a.device_type,
            if a.is_software() { " (software)" } else { "" }
        );
        println!(
            "    driver {}; vendor 0x{:04x} device 0x{:04x}",
            a.driver, a.vendor_device.0, a.vendor_device.1
        );
        println!(
            "    memory: {}",
            match a.device_memory {
                Some(m) => format!("{} ({})", gib(m), a.memory_source()),
                None => "not reported by this API".into(),
            }
        );
        if a.unified_memory {
            println!("    unified: the adapter's memory is the system's RAM (shared with the RAM tier)");
        }
        println!(
            "    limits: max_buffer_size {}, max_storage_buffer_binding_size {}, max_storage_buffers_per_shader_stage {}",
            l.max_buffer_size, l.max_storage_buffer_binding_size, l.max_storage_buffers_per_shader_stage
        );
        println!(
            "            max_compute_workgroup_size_x {}, max_compute_invocations_per_workgroup {}, max_compute_workgroups_per_dimension {}, max_compute_workgroup_storage_size {}",
            l.max_compute_workgroup_size_x,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension,
            l.max_compute_workgroup_storage_size
        );
        println!(
            "    features: SHADER_F16 {}, SUBGROUP {}, TIMESTAMP_QUERY {}",
            yes(a.shader_f16),
            yes(a.subgroup),
            yes(a.timestamps)
        );
        println!(
            "    key/value cache: --kv-cache f32{}",
            if a.f16_in_f32 {
                ", f16 (pack2x16float)"
            } else {
                "; not f16 (no pack2x16float on this adapter: wgpu's SHADER_F16_IN_F32)"
            }
        );
        let mut uses = Vec::new();
        if i == 0 {
            uses.push("--device gpu");
        }
        if auto == Some(i) {
            uses.push("--device auto");
        }
        if !uses.is_empty() {
            println!("    used by: {}", uses.join(", "));
        }
    }
    if auto.is_none() {
        println!("--device auto runs on the CPU: every adapter here is a software device");
    }
    Ok(())
}
