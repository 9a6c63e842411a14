//! Running the `gems` binary from tests (included with `#[path]` where it is used).

use std::process::Command;

/// (succeeded, stdout, stderr) of `gems args…`.
pub fn gems(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}
