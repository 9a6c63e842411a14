//! Slides in every format OpenSlide reads (.svs, .ndpi, .mrxs, .scn, DICOM folders, …) through
//! libopenslide, loaded at run time: the same binary runs without it, reading tiled TIFF with
//! gems' own reader.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::{Error, Result};

/// The file names tried, newest ABI first (OpenSlide 4 is `.so.1`, 3.4 is `.so.0`).
pub const LIBRARY_NAMES: [&str; 2] = ["libopenslide.so.1", "libopenslide.so.0"];

type Handle = *mut c_void;

/// The entry points gems calls (OpenSlide's C API, stable since 3.4).
struct Api {
    open: unsafe extern "C" fn(*const c_char) -> Handle,
    close: unsafe extern "C" fn(Handle),
    get_error: unsafe extern "C" fn(Handle) -> *const c_char,
    get_level_count: unsafe extern "C" fn(Handle) -> i32,
    get_level_dimensions: unsafe extern "C" fn(Handle, i32, *mut i64, *mut i64),
    get_level_downsample: unsafe extern "C" fn(Handle, i32) -> f64,
    get_property_value: unsafe extern "C" fn(Handle, *const c_char) -> *const c_char,
    read_region: unsafe extern "C" fn(Handle, *mut u32, i64, i64, i32, i64, i64),
    get_version: unsafe extern "C" fn() -> *const c_char,
    /// Kept loaded for the process's life: the pointers above point into it.
    _library: libloading::Library,
}

/// libopenslide, loaded on first use; the error says which names were tried.
fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(String::as_str)
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading libopenslide runs only its (and its dependencies') initializers.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => return bind(library).map_err(|e| format!("{name}: {e}")),
            Err(e) => tried.push(format!("{name} ({e})")),
        }
    }
    Err(format!(
        "libopenslide did not load: tried {}",
        tried.join(", ")
    ))
}

fn bind(library: libloading::Library) -> std::result::Result<Api, libloading::Error> {
    // SAFETY: each symbol is given the signature openslide.h declares for it; the pointers
    // stay valid while the library is loaded, which is as long as the Api holds it.
    unsafe {
        let open = *library.get(b"openslide_open\0")?;
        let close = *library.get(b"openslide_close\0")?;
        let get_error = *library.get(b"openslide_get_error\0")?;
        let get_level_count = *library.get(b"openslide_get_level_count\0")?;
        let get_level_dimensions = *library.get(b"openslide_get_level_dimensions\0")?;
        let get_level_downsample = *library.get(b"openslide_get_level_downsample\0")?;
        let get_property_value = *library.get(b"openslide_get_property_value\0")?;
        let read_region = *library.get(b"openslide_read_region\0")?;
        let get_version = *library.get(b"openslide_get_version\0")?;
        Ok(Api {
            open,
            close,
            get_error,
            get_level_count,
            get_level_dimensions,
            get_level_downsample,
            get_property_value,
            read_region,
            get_version,
            _library: library,
        })
    }
}

/// Whether libopenslide loads on this machine; else why not (the names tried).
pub fn available() -> std::result::Result<(), String> {
    api().map(|_| ()).map_err(str::to_string)
}

/// The loaded libopenslide's version (e.g. "3.4.1"), if it loads.
pub fn version() -> Option<String> {
    let api = api().ok()?;
    // SAFETY: OpenSlide returns a static NUL-terminated string.
    let v = unsafe { (api.get_version)() };
    (!v.is_null()).then(|| unsafe { CStr::from_ptr(v) }.to_string_lossy().into_owned())
}

/// One level as OpenSlide reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LevelInfo {
    /// Width and height in pixels.
    pub size: (u64, u64),
    /// Level-0 pixels per pixel of this level.
    pub downsample: f64,
    /// The tile size the file stores it in, where OpenSlide says (its `openslide.level[k]
    /// .tile-width` and `.tile-height` properties).
    pub tile: Option<(u32, u32)>,
}

/// A slide open in libopenslide. OpenSlide's handles are thread-safe: reads may run at once.
pub struct OpenSlide {
    path: PathBuf,
    api: &'static Api,
    handle: Handle,
    levels: Vec<LevelInfo>,
}

// SAFETY: OpenSlide documents its handles as safe to use from several threads at once.
unsafe impl Send for OpenSlide {}
// SAFETY: as above.
unsafe impl Sync for OpenSlide {}

impl OpenSlide {
    /// Opens `path`; refuses, naming the file, one OpenSlide does not recognise or cannot
    /// read, and says so when libopenslide is not there.
    pub fn open(path: &Path) -> Result<OpenSlide> {
        let api = api().map_err(|why| Error::Data(format!("{}: {why}", path.display())))?;
        let name = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::Data(format!("{}: a path with a NUL byte", path.display())))?;
        // SAFETY: a NUL-terminated path; the handle is closed on drop.
        let handle = unsafe { (api.open)(name.as_ptr()) };
        if handle.is_null() {
            let dicom = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("dcm"));
            let major = |v: &String| v.split('.').next()?.parse::<u32>().ok();
            let old = version().filter(|v| major(v).is_some_and(|m| m < 4));
            let why = match old {
                Some(v) if dicom => format!(": OpenSlide {v} reads no DICOM (4.0 and later do)"),
                _ => String::new(),
            };
            return Err(Error::Data(format!(
                "{} is not a slide OpenSlide recognises{why}",
                path.display()
            )));
        }
        let mut slide = OpenSlide {
            path: path.to_path_buf(),
            api,
            handle,
            levels: Vec::new(),
        };
        slide.check()?;
        // SAFETY: a valid handle.
        let count = unsafe { (api.get_level_count)(handle) };
        for k in 0..count.max(0) {
            let (mut w, mut h) = (0i64, 0i64);
            // SAFETY: a valid handle and level; the sizes are written to the two locals.
            let downsample = unsafe {
                (api.get_level_dimensions)(handle, k, &mut w, &mut h);
                (api.get_level_downsample)(handle, k)
            };
            let tile = slide
                .property(&format!("openslide.level[{k}].tile-width"))
                .zip(slide.property(&format!("openslide.level[{k}].tile-height")))
                .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)));
            slide.levels.push(LevelInfo {
                size: (w.max(0) as u64, h.max(0) as u64),
                downsample,
                tile,
            });
        }
        slide.check()?;
        Ok(slide)
    }

    /// Its levels, level 0 first.
    pub fn levels(&self) -> &[LevelInfo] {
        &self.levels
    }

    /// A property's value (`openslide.vendor`, `openslide.mpp-x`, …), if the slide has it.
    pub fn property(&self, name: &str) -> Option<String> {
        let name = CString::new(name).ok()?;
        // SAFETY: a valid handle and a NUL-terminated name; the value is copied out at once.
        let value = unsafe { (self.api.get_property_value)(self.handle, name.as_ptr()) };
        // SAFETY: OpenSlide returns NULL or a NUL-terminated string it owns.
        (!value.is_null()).then(|| {
            unsafe { CStr::from_ptr(value) }
                .to_string_lossy()
                .into_owned()
        })
    }

    /// The `w × h` pixels of `level` whose top-left pixel is (`x`, `y`) in *level-0*
    /// coordinates, as OpenSlide returns them: premultiplied ARGB, one u32 per pixel.
    pub fn read_argb(&self, level: usize, x: i64, y: i64, w: u32, h: u32) -> Result<Vec<u32>> {
        let mut out = vec![0u32; w as usize * h as usize];
        // SAFETY: a valid handle and a buffer of w·h pixels, as read_region writes.
        unsafe {
            (self.api.read_region)(
                self.handle,
                out.as_mut_ptr(),
                x,
                y,
                level as i32,
                w as i64,
                h as i64,
            )
        };
        self.check()?;
        Ok(out)
    }

    /// OpenSlide's error for this handle, if it is in error (a handle in error stays so).
    fn check(&self) -> Result<()> {
        // SAFETY: a valid handle; the message is copied out at once.
        let error = unsafe { (self.api.get_error)(self.handle) };
        if error.is_null() {
            return Ok(());
        }
        // SAFETY: a NUL-terminated string OpenSlide owns.
        let why = unsafe { CStr::from_ptr(error) }.to_string_lossy();
        Err(Error::Data(format!(
            "{}: OpenSlide: {why}",
            self.path.display()
        )))
    }
}

impl Drop for OpenSlide {
    fn drop(&mut self) {
        // SAFETY: the handle is valid and not used after this.
        unsafe { (self.api.close)(self.handle) }
    }
}

/// Premultiplied ARGB pixels to interleaved 8-bit RGB, transparent pixels (outside the
/// scanned area) white, as slide viewers show them.
pub fn argb_to_rgb8(argb: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(argb.len() * 3);
    for &p in argb {
        let a = p >> 24;
        let channel = |shift: u32| -> u8 {
            let c = (p >> shift) & 0xff;
            match a {
                0 => 255,
                255 => c as u8,
                a => ((c * 255 + a / 2) / a).min(255) as u8,
            }
        };
        out.extend([channel(16), channel(8), channel(0)]);
    }
    out
}
