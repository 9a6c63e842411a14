//! The CUDA kernels without a GPU: every source in `cuda/` compiles with NVRTC to machine code
//! for sm_80 and sm_90 (so ptxas checks every kernel, inline PTX included) and exports the
//! entry points the backend launches, the target a GPU gets follows what NVRTC knows, and `src/backend/cuda/params.rs`
//! is bindgen's current output for `include/gems_kernels.h`.
//!
//! NVRTC is found as scripts/test.sh provides it: `libnvrtc.so` on `LD_LIBRARY_PATH`
//! (the symlink `target/nvrtc/libnvrtc.so`, also named by `GEMS_NVRTC_LIB`). When the library
//! is not on the path but that symlink (or `GEMS_NVRTC_LIB`) exists, the test runs itself again
//! with its directory on `LD_LIBRARY_PATH`, so a plain `cargo test` works after one run of
//! scripts/test.sh. Without NVRTC the test fails; it never passes silently.
//!
//! Regenerate the bindings with `GEMS_BLESS_BINDINGS=1 cargo test --release --test cuda_kernels`.

use std::path::{Path, PathBuf};
use std::process::Command;

use gems::backend::cuda::kernels::{self, Target, CI_TARGETS, SOURCES};

/// Entry points each kernel family must export.
const ENTRIES: &[(&str, &[&str])] = &[
    (
        "conv",
        &[
            "conv2d_forward_f32",
            "conv2d_backward_data_f32",
            "conv2d_backward_filter_f32",
            "conv2d_forward_tf32",
            "conv2d_backward_data_tf32",
            "conv2d_backward_filter_tf32",
            "conv2d_forward_bf16",
            "conv2d_backward_data_bf16",
            "conv2d_backward_filter_bf16",
            "conv2d_forward_f16",
            "conv2d_backward_data_f16",
            "conv2d_backward_filter_f16",
            "conv2d_reduce_splits_f32",
        ],
    ),
    (
        "batchnorm",
        &[
            "batchnorm_stats_f32",
            "batchnorm_apply_f32",
            "batchnorm_apply_relu_f32",
            "batchnorm_backward_reduce_f32",
            "batchnorm_backward_reduce_relu_f32",
            "batchnorm_backward_dx_f32",
            "batchnorm_backward_dx_relu_f32",
            "batchnorm_stats_bf16",
            "batchnorm_apply_bf16",
            "batchnorm_apply_relu_bf16",
            "batchnorm_backward_reduce_bf16",
            "batchnorm_backward_reduce_relu_bf16",
            "batchnorm_backward_dx_bf16",
            "batchnorm_backward_dx_relu_bf16",
            "batchnorm_stats_f16",
            "batchnorm_apply_f16",
            "batchnorm_apply_relu_f16",
            "batchnorm_backward_reduce_f16",
            "batchnorm_backward_reduce_relu_f16",
            "batchnorm_backward_dx_f16",
            "batchnorm_backward_dx_relu_f16",
            "batchnorm_update_running_f32",
        ],
    ),
    (
        "groupnorm",
        &[
            "groupnorm_stats_f32",
            "groupnorm_apply_f32",
            "groupnorm_backward_reduce_f32",
            "groupnorm_param_grads_f32",
            "groupnorm_backward_dx_f32",
            "groupnorm_stats_bf16",
            "groupnorm_apply_bf16",
            "groupnorm_backward_reduce_bf16",
            "groupnorm_param_grads_bf16",
            "groupnorm_backward_dx_bf16",
            "groupnorm_stats_f16",
            "groupnorm_apply_f16",
            "groupnorm_backward_reduce_f16",
            "groupnorm_param_grads_f16",
            "groupnorm_backward_dx_f16",
        ],
    ),
    (
        "activation",
        &[
            "relu_forward_f32",
            "relu_backward_f32",
            "relu_forward_bf16",
            "relu_backward_bf16",
            "relu_forward_f16",
            "relu_backward_f16",
            "silu_forward_f32",
            "silu_backward_f32",
            "silu_forward_bf16",
            "silu_backward_bf16",
            "silu_forward_f16",
            "silu_backward_f16",
            "gelu_forward_f32",
            "gelu_backward_f32",
            "gelu_forward_bf16",
            "gelu_backward_bf16",
            "gelu_forward_f16",
            "gelu_backward_f16",
            "gelu_tanh_forward_f32",
            "gelu_tanh_backward_f32",
            "gelu_tanh_forward_bf16",
            "gelu_tanh_backward_bf16",
            "gelu_tanh_forward_f16",
            "gelu_tanh_backward_f16",
            "sigmoid_forward_f32",
            "sigmoid_backward_f32",
            "sigmoid_forward_bf16",
            "sigmoid_backward_bf16",
            "sigmoid_forward_f16",
            "sigmoid_backward_f16",
        ],
    ),
    (
        "pool",
        &[
            "max_pool_forward_f32",
            "max_pool_backward_f32",
            "avg_pool_forward_f32",
            "avg_pool_backward_f32",
            "adaptive_avg_pool_forward_f32",
            "adaptive_avg_pool_backward_f32",
            "global_avg_pool_forward_f32",
            "global_avg_pool_backward_f32",
            "max_pool_forward_bf16",
            "max_pool_backward_bf16",
            "avg_pool_forward_bf16",
            "avg_pool_backward_bf16",
            "adaptive_avg_pool_forward_bf16",
            "adaptive_avg_pool_backward_bf16",
            "global_avg_pool_forward_bf16",
            "global_avg_pool_backward_bf16",
            "max_pool_forward_f16",
            "max_pool_backward_f16",
            "avg_pool_forward_f16",
            "avg_pool_backward_f16",
            "adaptive_avg_pool_forward_f16",
            "adaptive_avg_pool_backward_f16",
            "global_avg_pool_forward_f16",
            "global_avg_pool_backward_f16",
        ],
    ),
    (
        "resize",
        &[
            "resize_bilinear_forward_f32",
            "resize_bilinear_backward_f32",
            "resize_bilinear_forward_bf16",
            "resize_bilinear_backward_bf16",
            "resize_bilinear_forward_f16",
            "resize_bilinear_backward_f16",
        ],
    ),
    (
        "loss",
        &[
            "softmax_cross_entropy_f32",
            "softmax_cross_entropy_backward_f32",
            "softmax_cross_entropy_bf16",
            "softmax_cross_entropy_backward_bf16",
            "softmax_cross_entropy_f16",
            "softmax_cross_entropy_backward_f16",
        ],
    ),
    ("optim", &["sgd_f32", "adam_f32", "nonfinite_f32"]),
    (
        "elementwise",
        &[
            "add_f32",
            "add_bf16",
            "add_f16",
            "add_relu_f32",
            "add_relu_bf16",
            "add_relu_f16",
            "add_assign_f32",
            "add_assign_bf16",
            "add_assign_f16",
            "mul_f32",
            "mul_bf16",
            "mul_f16",
            "fill_f32",
            "fill_bf16",
            "fill_f16",
            "copy_channels_f32",
            "copy_channels_bf16",
            "copy_channels_f16",
            "dropout_mask_f32",
            "dropout_mask_bf16",
            "dropout_mask_f16",
            "add_channel_bias_f32",
            "add_channel_bias_bf16",
            "add_channel_bias_f16",
            "channel_sum_f32",
            "channel_sum_bf16",
            "channel_sum_f16",
            "cast_f32_bf16",
            "cast_bf16_f32",
            "cast_f32_f16",
            "cast_f16_f32",
        ],
    ),
];

const REEXEC: &str = "GEMS_NVRTC_REEXEC";

/// Where scripts/test.sh puts NVRTC: the directory of `GEMS_NVRTC_LIB`, else `target/nvrtc`.
fn nvrtc_dir() -> Option<PathBuf> {
    let lib = std::env::var_os("GEMS_NVRTC_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/nvrtc/libnvrtc.so"));
    lib.exists()
        .then(|| lib.parent().map(Path::to_path_buf))
        .flatten()
}

/// Runs `body` where NVRTC can be loaded: here, or in a copy of this test process with
/// NVRTC's directory on `LD_LIBRARY_PATH` (the loader reads it only at start-up).
fn with_nvrtc(test: &str, body: impl FnOnce()) {
    if kernels::nvrtc_available() {
        return body();
    }
    let how = "NVRTC (libnvrtc.so) cannot be loaded. Run scripts/test.sh, which installs it \
               (libnvrtc11.2 / libnvrtc12) and links it as target/nvrtc/libnvrtc.so, or put a \
               libnvrtc.so on LD_LIBRARY_PATH";
    let dir = match nvrtc_dir() {
        Some(dir) if std::env::var_os(REEXEC).is_none() => dir,
        Some(dir) => panic!("{how} (tried {})", dir.display()),
        None => panic!("{how}"),
    };
    let mut path = std::ffi::OsString::from(dir.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", path)
        .env(REEXEC, "1")
        .output()
        .expect("running the test again with NVRTC on LD_LIBRARY_PATH");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("(run again with LD_LIBRARY_PATH={})\n{text}", dir.display());
    assert!(
        out.status.success(),
        "{test} failed with NVRTC from {}",
        dir.display()
    );
    assert!(
        text.contains("1 passed"),
        "{test} did not run in the copy with NVRTC"
    );
}

#[test]
fn every_kernel_compiles_to_machine_code_for_sm80_and_sm90() {
    let test = "every_kernel_compiles_to_machine_code_for_sm80_and_sm90";
    with_nvrtc(test, || {
        let names: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        let expected: Vec<&str> = ENTRIES.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, expected, "every source has its list of entry points");

        let started = std::time::Instant::now();
        type Compiled = (String, Target, Result<kernels::Module, String>);
        let results: Vec<Compiled> = std::thread::scope(|s| {
            let jobs: Vec<_> = SOURCES
                .iter()
                .flat_map(|(name, _)| CI_TARGETS.iter().map(move |t| (*name, *t)))
                .map(|(name, target)| {
                    s.spawn(move || {
                        let module = kernels::compile(name, target).map_err(|e| e.to_string());
                        (name.to_string(), target, module)
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()).collect()
        });
        let mut failures = Vec::new();
        for (name, target, module) in &results {
            let module = match module {
                Err(e) => {
                    failures.push(e.clone());
                    continue;
                }
                Ok(module) => module,
            };
            match &module.cubin {
                Some(cubin) if cubin.starts_with(b"\x7fELF") => {}
                _ => failures.push(format!("cuda/{name}.cu ({target}): no cubin (ELF)")),
            }
            let got = module.entries();
            let want = ENTRIES.iter().find(|(n, _)| n == name).unwrap().1;
            for w in want {
                if !got.iter().any(|g| g == w) {
                    failures.push(format!("cuda/{name}.cu ({target}): no entry {w}"));
                }
            }
            for g in &got {
                if !want.contains(&g.as_str()) {
                    failures.push(format!("cuda/{name}.cu ({target}): unlisted entry {g}"));
                }
            }
            println!("cuda/{name}.cu {target}: {} entries", got.len());
        }
        println!(
            "{} compilations by NVRTC {:?} in {:.1} s",
            results.len(),
            kernels::nvrtc_version().unwrap(),
            started.elapsed().as_secs_f64()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    });
}

#[test]
fn a_gpu_newer_than_nvrtc_gets_ptx_for_the_newest_architecture_it_knows() {
    with_nvrtc(
        "a_gpu_newer_than_nvrtc_gets_ptx_for_the_newest_architecture_it_knows",
        || {
            let known = kernels::known_archs().unwrap();
            assert!(known.contains(&80) && known.contains(&90), "{known:?}");
            let newer = known.iter().max().unwrap() + 1;
            let target = kernels::target_for((newer as i32 / 10, newer as i32 % 10), &known);
            assert_eq!(target, Ok(Target::Ptx(*known.iter().max().unwrap())));
            let module = kernels::compile("activation", Target::Ptx(90)).unwrap();
            assert!(
                module.cubin.is_none(),
                "PTX targets leave machine code to the driver"
            );
            assert!(
                module.ptx.contains(".target sm_90"),
                "{}",
                &module.ptx[..200]
            );
            assert!(module.entries().iter().any(|e| e == "relu_forward_f32"));
        },
    );
}

#[test]
fn each_gpu_gets_its_own_machine_code_when_nvrtc_knows_its_architecture() {
    let nvrtc_13 = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
    let cases = [
        ((8, 0), Ok(Target::Sass(80))),
        ((8, 6), Ok(Target::Sass(86))),
        ((9, 0), Ok(Target::Sass(90))),
        ((12, 0), Ok(Target::Sass(120))),
        // Unknown to this NVRTC: the newest older architecture's PTX, never a newer one's.
        ((10, 1), Ok(Target::Ptx(100))),
        ((13, 0), Ok(Target::Ptx(121))),
    ];
    for (cc, want) in cases {
        assert_eq!(
            kernels::target_for(cc, &nvrtc_13),
            want,
            "compute capability {cc:?}"
        );
    }
    let refused = kernels::target_for((7, 5), &nvrtc_13).unwrap_err();
    assert!(refused.contains("below 8.0"), "{refused}");
    let nvrtc_too_old = kernels::target_for((9, 0), &[70, 75]).unwrap_err();
    assert!(
        nvrtc_too_old.contains("none of sm_80 to sm_90"),
        "{nvrtc_too_old}"
    );
}

/// bindgen's output for include/gems_kernels.h, as committed in src/backend/cuda/params.rs.
fn bindings() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = root.join("include/gems_kernels.h");
    let out = bindgen::Builder::default()
        .header(header.to_str().unwrap())
        .allowlist_type("Gems.*")
        .derive_default(true)
        .derive_copy(true)
        .derive_debug(true)
        .derive_partialeq(true)
        .layout_tests(true)
        .generate_comments(false)
        .formatter(bindgen::Formatter::Prettyplease)
        .raw_line(
            "//! Parameter structs of the CUDA kernels: bindgen's output for \
             include/gems_kernels.h. GENERATED: do not edit.",
        )
        .raw_line(
            "//! Regenerate with `GEMS_BLESS_BINDINGS=1 cargo test --release --test \
             cuda_kernels`; tests/cuda_kernels.rs checks that this file is current.",
        )
        .generate()
        .expect("bindgen on include/gems_kernels.h (needs libclang: scripts/test.sh installs it)");
    out.to_string()
}

#[test]
fn bindgen_output_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda/params.rs");
    let fresh = bindings();
    if std::env::var_os("GEMS_BLESS_BINDINGS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "{} is not bindgen's current output for include/gems_kernels.h; regenerate it with \
         GEMS_BLESS_BINDINGS=1 cargo test --release --test cuda_kernels",
        path.display()
    );
}
