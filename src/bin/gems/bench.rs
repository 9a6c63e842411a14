//! `gems bench kernels`, `gems bench offload` and `gems info`: what the device and its
//! kernels do, measured.

use gems::backend::cuda::{self, ConvImpl};
use gems::backend::DeviceKind;
use gems::memory::human_bytes;
use gems::{models, DType, TrainConfig};

use crate::cli::{BenchConv, BenchKernelsArgs, BenchOffloadArgs};

pub fn kernels(a: BenchKernelsArgs) -> anyhow::Result<()> {
    use gems::bench;
    let kind = a.on.kind(DType::F32)?;
    let dtype = a.on.precision().activations(DType::F32);
    let convs = match a.conv {
        BenchConv::One(c) => vec![c],
        BenchConv::Both => vec![ConvImpl::Native, ConvImpl::Cudnn],
    };
    // One device per convolution path (on a GPU, both on the same one).
    let devices = convs
        .iter()
        .map(|&c| gems::Device::open(kind, a.on.precision(), c, &kind.to_string(), 0, None))
        .collect::<gems::Result<Vec<_>>>()?;
    let g = models::build(&a.model, a.image_size, 1000)?;
    let shapes = bench::conv_shapes(&g, a.batch)?;
    println!(
        "{} at {}², batch {}, {} activations: {} distinct convolutions on {}",
        a.model,
        a.image_size,
        a.batch,
        dtype.name(),
        shapes.len(),
        devices
            .iter()
            .map(|d| d.backend().name())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let both = devices.len() == 2;
    if both {
        println!(
            "{:<28} {:>5} {:>8}  {:^24}  {:^24}  {:^24}",
            "convolution (first node)",
            "count",
            "GFLOP",
            "forward ms",
            "backward-data ms",
            "backward-filter ms"
        );
        let sub = format!("{:>8} {:>8} {:>6}", "native", "cudnn", "ratio");
        println!(
            "{:<43}  {sub}  {sub}  {sub}",
            "(ratio: native time / cuDNN time)"
        );
    } else {
        println!(
            "{:<28} {:>5} {:>8}  {:>21}  {:>21}  {:>21}",
            "convolution (first node)",
            "count",
            "GFLOP",
            "forward ms TFLOP/s",
            "bwd-data ms TFLOP/s",
            "bwd-filter ms TFLOP/s"
        );
    }
    let mut rows = Vec::new();
    // Seconds of each pass over the whole model, per device.
    let mut total = vec![[0.0f64; 3]; devices.len()];
    let mut flops = 0.0;
    for s in &shapes {
        let t = devices
            .iter()
            .map(|d| bench::conv_passes(d, &s.geom, dtype, a.repeats))
            .collect::<gems::Result<Vec<_>>>()?;
        let f = s.flops();
        let cells: Vec<String> = (0..3)
            .map(|pass| match t.as_slice() {
                [one] => format!("{:>10.3} {:>10.2}", 1e3 * one[pass], f / one[pass] / 1e12),
                [native, cudnn] => format!(
                    "{:>8.3} {:>8.3} {:>5.2}x",
                    1e3 * native[pass],
                    1e3 * cudnn[pass],
                    native[pass] / cudnn[pass]
                ),
                _ => unreachable!("one or two convolution paths"),
            })
            .collect();
        println!(
            "{:<28} {:>5} {:>8.2}  {}  {}  {}",
            s.example,
            s.count,
            f / 1e9,
            cells[0],
            cells[1],
            cells[2]
        );
        for (acc, times) in total.iter_mut().zip(&t) {
            for (a, sec) in acc.iter_mut().zip(times) {
                *a += sec * s.count as f64;
            }
        }
        flops += f * s.count as f64;
        let mut row = serde_json::json!({
            "node": s.example, "count": s.count, "geom": format!("{:?}", s.geom),
            "gflop": f / 1e9, "seconds": t[0],
        });
        if both {
            row["cudnn_seconds"] = serde_json::json!(t[1]);
        }
        rows.push(row);
    }
    // The card's peaks, for a GPU whose driver reports its clocks.
    let gpu = match kind {
        DeviceKind::Cuda { ordinal } => cuda::devices()?.into_iter().nth(ordinal),
        DeviceKind::Cpu => None,
    };
    let peak_flops = gpu.as_ref().and_then(|g| g.peak_fp32_flops());
    let peak_bw = gpu.as_ref().and_then(|g| g.peak_bandwidth());
    for (conv, total) in convs.iter().zip(&total) {
        println!(
            "all {} convolutions{}: forward {:.2}, backward-data {:.2}, backward-filter {:.2} TFLOP/s{}",
            shapes.iter().map(|s| s.count).sum::<usize>(),
            if both { format!(" ({conv})") } else { String::new() },
            flops / total[0] / 1e12,
            flops / total[1] / 1e12,
            flops / total[2] / 1e12,
            peak_flops.map_or(String::new(), |p| format!(
                " ({:.0}%, {:.0}%, {:.0}% of the card's {:.1} TFLOP/s f32 FMA peak)",
                100.0 * flops / total[0] / p,
                100.0 * flops / total[1] / p,
                100.0 * flops / total[2] / p,
                p / 1e12
            ))
        );
    }
    let device = &devices[0];
    // The largest activation of the model at this batch, seen per channel.
    let widest = g
        .values
        .iter()
        .filter(|v| v.shape.rank() == 3)
        .max_by_key(|v| v.shape.numel())
        .map(|v| v.shape.clone())
        .ok_or_else(|| anyhow::anyhow!("{} has no image-shaped activation", a.model))?;
    let (c, h, w) = (widest.dim(0), widest.dim(1), widest.dim(2));
    let geom = gems::backend::ChannelGeom {
        n: a.batch,
        c,
        hw: h * w,
    };
    let bw = bench::memory_bound(device, &geom, dtype, a.repeats)?;
    let copy = bw[0].gb_per_s();
    println!(
        "memory-bound kernels over {}×{c}×{h}×{w} {}:",
        a.batch,
        dtype.name()
    );
    if let Some(p) = peak_bw {
        println!("  (the card's peak: {:.1} GB/s)", p / 1e9);
    }
    for b in &bw {
        println!(
            "  {:<24} {:>8.1} GB/s  {:>5.1}% of copy{}",
            b.kernel,
            b.gb_per_s(),
            100.0 * b.gb_per_s() / copy,
            peak_bw.map_or(String::new(), |p| format!(
                "  {:>5.1}% of peak",
                100.0 * b.gb_per_s() * 1e9 / p
            ))
        );
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "model": a.model, "image_size": a.image_size, "batch": a.batch,
            "device": device.backend().name(), "repeats": a.repeats, "conv": a.conv.to_string(),
            "convolutions": rows, "memory_bound": bw,
            "peak_fp32_flops": peak_flops, "peak_bytes_per_s": peak_bw,
            "cudnn_algorithms": devices.iter().flat_map(|d| d.backend().conv_algorithms()).collect::<Vec<_>>(),
        });
        gems::core::files::write_output(path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    for d in &devices {
        let lines = d.backend().conv_algorithms();
        if !lines.is_empty() {
            println!("  cuDNN algorithms per convolution shape:");
            for l in lines {
                println!("    {l}");
            }
        }
    }
    Ok(())
}

pub fn offload(a: BenchOffloadArgs) -> anyhow::Result<()> {
    use gems::bench;
    let kind = a.on.kind(DType::F32)?;
    let device = gems::Device::open(
        kind,
        a.on.precision(),
        ConvImpl::Native,
        &kind.to_string(),
        0,
        None,
    )?;
    println!("host link of {}:", device.backend().name());
    let link = bench::host_link(&device, 256 << 20, 5)?;
    for b in &link {
        println!("  {:<20} {:>6.1} GB/s", b.kernel, b.gb_per_s());
    }
    let host_link = gems::fit::link_model(kind, &link);
    drop(device);
    let mut base = TrainConfig::new(a.batch, 1);
    base.device = kind;
    base.precision = a.on.precision();
    let models = a
        .models
        .split(',')
        .map(|m| models::build(m.trim(), a.image_size, a.classes))
        .collect::<gems::Result<Vec<_>>>()?;
    println!(
        "epoch of {} images at {}², batch {}, {} classes:",
        a.images, a.image_size, a.batch, a.classes
    );
    println!(
        "{:<20} {:<24} {:>10} {:>11} {:>12} {:>12}",
        "model", "saved activations", "s/epoch", "× baseline", "device peak", "host peak"
    );
    let runs = gems::fit::study::offload_study(&base, &models, a.images, &host_link)?;
    let mut baseline = f64::NAN;
    for r in &runs {
        match &r.seconds {
            Ok(s) => {
                if r.variant == "baseline" {
                    baseline = *s;
                }
                println!(
                    "{:<20} {:<24} {:>10.2} {:>11.2} {:>12} {:>12}",
                    r.model,
                    r.variant,
                    s,
                    s / baseline,
                    human_bytes(r.device_peak),
                    human_bytes(r.host_peak)
                );
            }
            Err(e) => println!("{:<20} {:<24} failed: {e}", r.model, r.variant),
        }
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({ "link": link, "runs": runs });
        gems::core::files::write_output(path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    Ok(())
}

pub fn info() -> anyhow::Result<()> {
    println!("gems {}", env!("CARGO_PKG_VERSION"));
    println!(
        "CPU: {}, {} threads",
        gems::bench::cpu_model(),
        rayon::current_num_threads()
    );
    println!("CUDA libraries (GEMS_CUDA_LIB_DIRS, the toolkit, Python's nvidia packages, the loader's path):");
    for lib in cuda::libs::load() {
        match (&lib.path, &lib.problem) {
            (Some(path), _) => println!("  {:<7} {}", lib.role, path.display()),
            (None, why) => println!(
                "  {:<7} not found: {}",
                lib.role,
                why.as_deref().unwrap_or("")
            ),
        }
    }
    match cuda::kernels::nvrtc_version() {
        Some((major, minor)) => {
            let archs = cuda::kernels::known_archs()
                .map(|a| {
                    a.iter()
                        .map(|a| format!("sm_{a}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|e| e.to_string());
            println!("  NVRTC {major}.{minor} compiles the kernels to machine code for {archs}")
        }
        None => println!(
            "  NVRTC cannot be used: cudarc opens it as libnvrtc.so or libnvrtc.so.<major>; \
             link the library found under one of those names in a folder on LD_LIBRARY_PATH"
        ),
    }
    match cuda::cudnn::load() {
        Ok(v) => println!(
            "  cuDNN {} runs --conv cudnn",
            cuda::cudnn::version_string(v)
        ),
        Err(e) => println!("  {e}"),
    }
    match cuda::kernels::cache_dir() {
        Some(dir) => println!("kernel cache: {}", dir.display()),
        None => println!("kernel cache: none (set GEMS_CACHE_DIR or HOME)"),
    }
    match cuda::devices() {
        Ok(gpus) if gpus.is_empty() => println!("GPUs: none"),
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "cuda:{} {}: compute capability {}.{}, {} SMs, {} total, {} free{}",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.multiprocessors,
                    human_bytes(g.total_memory),
                    human_bytes(g.free_memory),
                    g.peak_fp32_flops().zip(g.peak_bandwidth()).map_or(
                        String::new(),
                        |(f, b)| format!(
                            "; peaks {:.1} TFLOP/s f32 FMA, {:.0} GB/s",
                            f / 1e12,
                            b / 1e9
                        )
                    )
                );
            }
        }
        Err(e) => println!("GPUs: none usable ({e})"),
    }
    println!("--device auto picks: {}", DeviceKind::parse("auto")?);
    Ok(())
}
