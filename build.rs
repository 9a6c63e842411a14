//! With the `cuda-emu` feature (on in every `cargo test`: the crate is its own dev-dependency
//! with that feature), builds the emulated CUDA driver of `scripts/cuda_emu/` with the C++
//! compiler the `cc` crate finds, into `$OUT_DIR/cuda_emu`:
//!
//! - `libcuda.so.1` (driver.cpp), `libcublas.so.13` (cublas.cpp) and `libcudnn.so.9`
//!   (cudnn.cpp), the stand-ins cudarc loads;
//! - `libgems_emu_kernels.so` (kernels.cpp: every kernel of `cuda/*.cu` under emu.h, with the
//!   memory check and the race check of racecheck.cpp compiled in), which the driver loads;
//! - `race_test` and `race_test_planted` (race_test.cpp on kernels of `cuda/*.cu`, and on
//!   planted copies: conv.cu's tile loop and gems_device.h's block_sum each without a
//!   `__syncthreads`, elementwise.cu's fill writing one element past its output: the bugs the
//!   checks must report);
//! - `libnvrtc.so`, a link to the system's NVRTC (which cudarc opens by that name), when found.
//!
//! The folder reaches the tests as `GEMS_CUDA_EMU_DIR`, and the test binaries get it as a
//! run path so cudarc's bare-name loads find the libraries there. A plain `cargo build` builds
//! none of it and needs no C++ compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if std::env::var_os("CARGO_FEATURE_CUDA_EMU").is_none() {
        return;
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let emu = root.join("scripts/cuda_emu");
    for dir in ["scripts/cuda_emu", "cuda", "include"] {
        println!("cargo::rerun-if-changed={}", root.join(dir).display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("cuda_emu");
    std::fs::create_dir_all(&out).unwrap();
    let cuda = root.join("cuda");
    let include = root.join("include");

    // The planted bug: conv.cu without the barrier that ends each tile of its K loop.
    let planted = out.join("planted");
    std::fs::create_dir_all(&planted).unwrap();
    let conv = std::fs::read_to_string(cuda.join("conv.cu")).unwrap();
    let end_of_tile = "            }\n        }\n        __syncthreads();\n    }\n";
    assert_eq!(
        conv.matches(end_of_tile).count(),
        1,
        "conv.cu's tile loop moved: re-plant"
    );
    std::fs::write(
        planted.join("conv.cu"),
        conv.replace(end_of_tile, "            }\n        }\n    }\n"),
    )
    .unwrap();
    // block_sum without the barrier between the warps' writes of scratch and its reads.
    plant(
        &include.join("gems_device.h"),
        &planted,
        "    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n",
        "    if (lane == 0) scratch[warp] = v;\n",
    );
    // fill writing one element past its output.
    plant(
        &cuda.join("elementwise.cu"),
        &planted,
        "GEMS_FOR(i, numel) st(s, i, value);",
        "GEMS_FOR(i, numel + 1) st(s, i, value);",
    );

    std::fs::write(out.join("kernels.inc"), kernel_table(&cuda, &include, &emu)).unwrap();

    let base = |opt: &str| {
        let mut c = compiler();
        c.args(["-std=c++20", opt, "-ffp-contract=off", "-fPIC", "-pthread"]);
        c
    };
    // Kernels under emu.h, compiled to an object with GCC's access instrumentation, which the
    // checks of racecheck.cpp answer (linked without ThreadSanitizer's runtime).
    let kernels = |dirs: &[&Path], src: &str, obj: &str| {
        let mut c = base("-O2");
        for d in dirs {
            c.arg("-I").arg(d);
        }
        c.arg("-I")
            .arg(&include)
            .arg("-I")
            .arg(&emu)
            .arg("-I")
            .arg(&out);
        c.arg("-include").arg(emu.join("emu.h"));
        c.args([
            "-fsanitize=thread",
            "--param=tsan-instrument-func-entry-exit=0",
        ]);
        c.args(["-fvisibility=hidden", "-c", "-o"])
            .arg(out.join(obj))
            .arg(emu.join(src));
        c
    };
    let link = |inputs: &[&str], name: &str, shared: bool| {
        let mut c = base("-O2");
        if shared {
            c.args(["-shared", "-Wl,-z,defs"])
                .arg(format!("-Wl,-soname,{name}"));
        }
        c.arg("-o").arg(out.join(name));
        for i in inputs {
            let local = out.join(i);
            c.arg(if local.exists() { local } else { emu.join(i) });
        }
        c
    };
    let plain = [cuda.as_path()];
    let with_plant = [planted.as_path(), cuda.as_path()];
    let mut racecheck = base("-O2");
    racecheck
        .arg("-include")
        .arg(emu.join("emu.h"))
        .args(["-c", "-o"]);
    racecheck
        .arg(out.join("racecheck.o"))
        .arg(emu.join("racecheck.cpp"));
    run_all(vec![
        racecheck,
        kernels(&plain, "kernels.cpp", "kernels.o"),
        kernels(&plain, "race_test.cpp", "race_test.o"),
        kernels(&with_plant, "race_test.cpp", "race_test_planted.o"),
    ]);
    let mut driver = link(&["driver.cpp"], "libcuda.so.1", true);
    driver.arg("-ldl");
    run_all(vec![driver]);
    // cuBLAS and cuDNN queue their work on the driver's streams.
    let on_driver = |src: &str, name: &str| {
        let mut c = link(&[src], name, true);
        c.arg("-L")
            .arg(&out)
            .args(["-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN"]);
        c
    };
    run_all(vec![
        on_driver("cublas.cpp", "libcublas.so.13"),
        on_driver("cudnn.cpp", "libcudnn.so.9"),
        link(
            &["kernels.o", "racecheck.o"],
            "libgems_emu_kernels.so",
            true,
        ),
        link(&["race_test.o", "racecheck.o"], "race_test", false),
        link(
            &["race_test_planted.o", "racecheck.o"],
            "race_test_planted",
            false,
        ),
    ]);

    link_nvrtc(&out);
    println!("cargo::rustc-env=GEMS_CUDA_EMU_DIR={}", out.display());
    println!("cargo::rustc-link-arg-tests=-Wl,-rpath,{}", out.display());
}

/// A copy of `src` in `dir` with `from` (found once) replaced by `to`.
fn plant(src: &Path, dir: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(src).unwrap();
    assert_eq!(
        text.matches(from).count(),
        1,
        "{}: the planted line moved: re-plant",
        src.display()
    );
    std::fs::write(dir.join(src.file_name().unwrap()), text.replace(from, to)).unwrap();
}

/// The C++ compiler `cc` finds (CXX, or the platform's), as a command.
fn compiler() -> Command {
    cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .debug(false)
        .warnings(false)
        .get_compiler()
        .to_command()
}

/// `GEMS_KERNEL(name)` for every `extern "C"` kernel of cuda/*.cu, as the preprocessor stamps
/// them.
fn kernel_table(cuda: &Path, include: &Path, emu: &Path) -> String {
    let mut sources: Vec<PathBuf> = std::fs::read_dir(cuda)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    let mut names = std::collections::BTreeSet::new();
    for src in sources {
        let mut c = compiler();
        c.args(["-std=c++20", "-E", "-P", "-x", "c++"])
            .arg("-I")
            .arg(include)
            .arg("-include")
            .arg(emu.join("emu.h"))
            .arg(&src);
        let text = output(c);
        for piece in text.split("extern \"C\"").skip(1) {
            let mut words = piece.split_whitespace();
            if words.next() != Some("void") {
                continue;
            }
            let name: String = words
                .next()
                .unwrap_or_default()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && !name.starts_with("__") {
                names.insert(name);
            }
        }
    }
    names
        .iter()
        .map(|n| format!("GEMS_KERNEL({n})\n"))
        .collect()
}

/// Runs the commands side by side and fails the build with the output of any that fails.
fn run_all(commands: Vec<Command>) {
    let children: Vec<_> = commands
        .into_iter()
        .map(|mut c| {
            let shown = shown(&c);
            let child = c
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{shown}: {e} (the cuda-emu feature needs g++)"));
            (shown, child)
        })
        .collect();
    for (shown, child) in children {
        let o = child.wait_with_output().unwrap();
        if !o.status.success() {
            panic!(
                "{shown} failed:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

/// The command line, without the environment.
fn shown(c: &Command) -> String {
    std::iter::once(c.get_program())
        .chain(c.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn output(mut c: Command) -> String {
    let o = c
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (the cuda-emu feature needs g++)", shown(&c)));
    assert!(
        o.status.success(),
        "{} failed:\n{}",
        shown(&c),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// cudarc opens NVRTC as `libnvrtc.so` (or `.so.<major>` of the CUDA it was built for), which
/// Debian's `libnvrtc.so.11.2` is not: a link by that name in the emulator's folder, which the
/// test binaries search. Without NVRTC the GPU tests say that it is missing.
fn link_nvrtc(out: &Path) {
    let cache = Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let found = cache
        .lines()
        .filter(|l| l.trim_start().starts_with("libnvrtc.so"))
        .filter_map(|l| l.split("=> ").nth(1))
        .map(PathBuf::from)
        .find(|p| p.is_file());
    let link = out.join("libnvrtc.so");
    let _ = std::fs::remove_file(&link);
    match found {
        Some(real) => std::os::unix::fs::symlink(real, &link).unwrap(),
        None => println!(
            "cargo::warning=no NVRTC found (ldconfig -p): the emulated GPU tests will say so"
        ),
    }
}
