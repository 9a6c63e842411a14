//! A folder of one run's checkpoints: `step-NNNNNN.safetensors` files and a manifest,
//! `gems-run.json`, naming the run they belong to and the checkpoints it wrote.
//!
//! A folder is never silently shared. It belongs to one live run: opening it takes an advisory
//! lock (`flock` on `.gems-lock`, which records the holder's pid, host and start time) before
//! anything is written, and a second run into it is refused naming the holder; the kernel
//! releases the lock of a process that died, and the next run notes whose it was. A run also
//! refuses a folder that holds another run's checkpoints unless it resumes from a checkpoint in
//! it (then it is the same run continued) or the caller allows overwriting (then the other
//! run's checkpoints are removed first). Temporary files
//! that an interrupted write left behind are removed on opening, and the oldest checkpoints
//! may be pruned to keep the last few.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::core::files::{temporary_target, write_atomically};
use crate::{Error, Result};

const MANIFEST: &str = "gems-run.json";
const LOCK: &str = ".gems-lock";
const FORMAT: &str = "gems-run-1";

/// The manifest: whose folder this is, and the checkpoints written into it, oldest first.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    run: String,
    model: String,
    checkpoints: Vec<Written>,
}

/// One checkpoint in the manifest.
#[derive(Debug, Serialize, Deserialize)]
struct Written {
    step: usize,
    file: String,
}

/// How [`CheckpointFolder::open`] treats a folder that already holds checkpoints.
#[derive(Clone, Debug, Default)]
pub struct FolderRules {
    /// The checkpoint the run resumed from: a folder holding it is the run's own.
    pub resumed_from: Option<PathBuf>,
    /// Remove another run's checkpoints instead of refusing the folder.
    pub overwrite: bool,
    /// Keep only the newest this many of the run's checkpoints (`None`: all).
    pub keep_last: Option<usize>,
}

/// A run's checkpoint folder, opened by the one process that writes checkpoints.
#[derive(Debug)]
pub struct CheckpointFolder {
    dir: PathBuf,
    manifest: Manifest,
    keep_last: Option<usize>,
    /// What opening removed: stale temporary files, and with `overwrite` another run's
    /// checkpoints.
    pub removed: Vec<PathBuf>,
    /// The holder of a lock left by a run that ended without releasing it (killed), which
    /// opening took over: `pid 123 on host, since …`.
    pub recovered_lock: Option<String>,
    /// The folder's lock, held while this value lives.
    _lock: FolderLock,
}

/// A folder's lock file, locked; emptied when let go (an empty lock file tells the next run
/// this one ended cleanly; a killed run leaves its name there, which the next run reports).
#[derive(Debug)]
struct FolderLock(std::fs::File);

impl Drop for FolderLock {
    fn drop(&mut self) {
        let _ = self.0.set_len(0);
    }
}

/// The file of the checkpoint after `step` steps in `dir`.
pub fn checkpoint_path(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:06}.safetensors"))
}

fn is_checkpoint(name: &str) -> bool {
    name.starts_with("step-") && name.ends_with(".safetensors")
}

/// A temporary file of an interrupted atomic write of a checkpoint or the manifest (see
/// `write_atomically`).
fn is_stale(name: &str) -> bool {
    temporary_target(name).is_some_and(|t| is_checkpoint(t) || t == MANIFEST)
}

impl CheckpointFolder {
    /// Opens (creating it if need be) `dir` for the checkpoints of run `run` of `model`.
    /// Refuses, as [`Error::FolderInUse`], a folder holding another run's checkpoints unless
    /// `rules` resumes from one of them or allows overwriting.
    pub fn open(dir: &Path, run: &str, model: &str, rules: &FolderRules) -> Result<Self> {
        if rules.keep_last == Some(0) {
            return Err(Error::Config(
                "keeping the last 0 checkpoints would keep none".into(),
            ));
        }
        let io = |what: &str, path: &Path, e: std::io::Error| Error::BadInput {
            path: path.to_path_buf(),
            why: format!("cannot {what}: {e}"),
        };
        std::fs::create_dir_all(dir).map_err(|e| io("create the folder", dir, e))?;
        let (lock, recovered_lock) = lock(dir)?;
        let mut removed = Vec::new();
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| io("list the folder", dir, e))? {
            let entry = entry.map_err(|e| io("list the folder", dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_stale(&name) {
                std::fs::remove_file(entry.path())
                    .map_err(|e| io("remove a stale temporary file", &entry.path(), e))?;
                removed.push(entry.path());
            } else if is_checkpoint(&name) {
                found.push(name);
            }
        }
        found.sort();
        let manifest_path = dir.join(MANIFEST);
        let previous =
            match std::fs::read(&manifest_path) {
                Ok(bytes) => Some(serde_json::from_slice::<Manifest>(&bytes).map_err(|e| {
                    Error::BadInput {
                        path: manifest_path.clone(),
                        why: format!("is not a gems run manifest: {e}"),
                    }
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(io("read", &manifest_path, e)),
            };
        let resumes_here = match &rules.resumed_from {
            Some(file) => same_folder(file, dir),
            None => false,
        };
        let ours = previous.as_ref().is_some_and(|m| m.run == run);
        let mut checkpoints = match previous {
            Some(m) if ours || resumes_here => m.checkpoints,
            _ => Vec::new(),
        };
        let foreign = !(ours || resumes_here || found.is_empty());
        if foreign && !rules.overwrite {
            return Err(Error::FolderInUse {
                dir: dir.to_path_buf(),
                checkpoints: found.len(),
                first: found[0].clone(),
                last: found[found.len() - 1].clone(),
            });
        }
        if foreign {
            for name in &found {
                let path = dir.join(name);
                std::fs::remove_file(&path).map_err(|e| io("remove", &path, e))?;
                removed.push(path);
            }
        }
        // Entries whose file is gone (removed by hand) are forgotten.
        checkpoints.retain(|w| dir.join(&w.file).is_file());
        let folder = CheckpointFolder {
            dir: dir.to_path_buf(),
            manifest: Manifest {
                format: FORMAT.into(),
                run: run.into(),
                model: model.into(),
                checkpoints,
            },
            keep_last: rules.keep_last,
            removed,
            recovered_lock,
            _lock: lock,
        };
        folder.write_manifest()?;
        Ok(folder)
    }

    /// Where the checkpoint after `step` steps goes.
    pub fn path(&self, step: usize) -> PathBuf {
        checkpoint_path(&self.dir, step)
    }

    /// Records the checkpoint just written at [`CheckpointFolder::path`]`(step)` and prunes
    /// the oldest beyond the last `keep_last`; returns the files pruned.
    pub fn written(&mut self, step: usize) -> Result<Vec<PathBuf>> {
        let file = format!("step-{step:06}.safetensors");
        let list = &mut self.manifest.checkpoints;
        list.retain(|w| w.file != file);
        list.push(Written { step, file });
        list.sort_by_key(|w| w.step);
        let extra = self.keep_last.map_or(0, |n| list.len().saturating_sub(n));
        let pruned: Vec<PathBuf> = list.drain(..extra).map(|w| self.dir.join(w.file)).collect();
        // The manifest first: a kill between the two leaves a file the manifest forgets,
        // never a manifest naming a file that is gone.
        self.write_manifest()?;
        for path in &pruned {
            std::fs::remove_file(path).map_err(|e| Error::BadInput {
                path: path.clone(),
                why: format!("cannot remove an old checkpoint: {e}"),
            })?;
        }
        Ok(pruned)
    }

    /// The steps of the checkpoints the folder holds for this run, oldest first.
    pub fn steps(&self) -> Vec<usize> {
        self.manifest.checkpoints.iter().map(|w| w.step).collect()
    }

    fn write_manifest(&self) -> Result<()> {
        let json = serde_json::to_vec_pretty(&self.manifest)
            .map_err(|e| Error::Internal(format!("the run manifest: {e}")))?;
        write_atomically(&self.dir.join(MANIFEST), &json)
    }
}

/// Takes `dir`'s lock for this process, or refuses the folder naming the live run that holds
/// it. Returns the lock file (the lock lasts as long as it is open) and the holder a previous,
/// dead run left recorded in it, if any.
fn lock(dir: &Path) -> Result<(FolderLock, Option<String>)> {
    use std::io::{Read, Seek, Write};
    let path = dir.join(LOCK);
    crate::core::files::check_output(&path)?;
    let io = |what: &str, e: std::io::Error| Error::BadInput {
        path: path.clone(),
        why: format!("cannot {what} the folder's lock: {e}"),
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io("open", e))?;
    let mut before = String::new();
    let _ = file.read_to_string(&mut before);
    let before = before.trim().to_string();
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(Error::FolderLocked {
                dir: dir.to_path_buf(),
                holder: if before.is_empty() {
                    "a process that has not written its name yet".into()
                } else {
                    before
                },
            })
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io("take", e)),
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into());
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let me = format!(
        "pid {} on {host}, since {since} (seconds since 1970)",
        std::process::id()
    );
    file.set_len(0).map_err(|e| io("write", e))?;
    file.rewind().map_err(|e| io("write", e))?;
    file.write_all(me.as_bytes()).map_err(|e| io("write", e))?;
    Ok((FolderLock(file), (!before.is_empty()).then_some(before)))
}

/// Whether `file` lies directly in `dir` (both resolved, so `./ck` and `ck/` agree).
fn same_folder(file: &Path, dir: &Path) -> bool {
    let parent = file
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match (parent.canonicalize(), dir.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, name: &str) {
        std::fs::write(dir.join(name), b"x").unwrap();
    }

    #[test]
    fn refuses_another_runs_folder_and_keeps_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut a =
            CheckpointFolder::open(dir.path(), "aaaa", "m", &FolderRules::default()).unwrap();
        touch(dir.path(), "step-000001.safetensors");
        a.written(1).unwrap();
        // While the first is open, the folder is its run's alone, even for the same run.
        let e =
            CheckpointFolder::open(dir.path(), "aaaa", "m", &FolderRules::default()).unwrap_err();
        assert!(e.to_string().contains("in use by another run (pid"), "{e}");
        drop(a);
        let e =
            CheckpointFolder::open(dir.path(), "bbbb", "m", &FolderRules::default()).unwrap_err();
        assert!(e.to_string().contains("of another run"), "{e}");
        assert!(dir.path().join("step-000001.safetensors").is_file());
        // The same run continues; resuming from a file in the folder adopts it.
        let again = CheckpointFolder::open(dir.path(), "aaaa", "m", &FolderRules::default());
        assert!(
            again.unwrap().recovered_lock.is_none(),
            "a clean end leaves no note"
        );
        let resumed = FolderRules {
            resumed_from: Some(dir.path().join("step-000001.safetensors")),
            ..FolderRules::default()
        };
        let b = CheckpointFolder::open(dir.path(), "bbbb", "m", &resumed).unwrap();
        assert_eq!(b.steps(), vec![1]);
    }

    #[test]
    fn overwrite_removes_the_other_run_and_stale_files() {
        let dir = tempfile::tempdir().unwrap();
        touch(dir.path(), "step-000004.safetensors");
        touch(dir.path(), ".step-000005.safetensors.4242.tmp");
        touch(dir.path(), "notes.txt");
        let rules = FolderRules {
            overwrite: true,
            ..FolderRules::default()
        };
        let f = CheckpointFolder::open(dir.path(), "cccc", "m", &rules).unwrap();
        assert_eq!(f.removed.len(), 2);
        assert!(dir.path().join("notes.txt").is_file());
        assert!(!dir.path().join("step-000004.safetensors").exists());
        assert!(f.steps().is_empty());
    }

    #[test]
    fn keeps_the_last_n() {
        let dir = tempfile::tempdir().unwrap();
        let rules = FolderRules {
            keep_last: Some(2),
            ..FolderRules::default()
        };
        let mut f = CheckpointFolder::open(dir.path(), "dddd", "m", &rules).unwrap();
        for step in [2, 4, 6] {
            touch(dir.path(), &format!("step-{step:06}.safetensors"));
            f.written(step).unwrap();
        }
        assert_eq!(f.steps(), vec![4, 6]);
        assert!(!dir.path().join("step-000002.safetensors").exists());
        assert!(dir.path().join("step-000004.safetensors").exists());
    }
}
