//! Spatial parallelism's tiles. Each sample's H×W plane is split into an R×C grid, tile t
//! (row-major) on rank t of a tile group; every map an op reads or writes is split the same
//! way, each axis into balanced parts ([`part`]), so which rank owns which pixel of any value
//! follows from the value's global shape alone, the same on every rank.
//!
//! An op on tiles computes exactly the part of its output its rank owns. A window op (a
//! convolution, a pool) first gathers the input rows and columns its windows read
//! ([`gather`]: the rank's own part, and a halo from the ranks that own the rest), and its
//! backward returns the halo's gradients to their owners, who add them ([`scatter_add`]).
//! Batch normalization sums its statistics over the group. Nothing is approximate: the same
//! numbers as one device, up to the order of additions.

use std::cell::Cell;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::time::Instant;

use crate::backend::MapWindow;
use crate::comm::Comm;
use crate::memory::Category;
use crate::tensor::{Device, Shape, Tensor};
use crate::Result;

use super::Ctx;

/// An R×C grid of tiles (1×1: no split).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Grid {
    /// R: parts of the height.
    pub rows: usize,
    /// C: parts of the width.
    pub cols: usize,
}

impl Grid {
    /// No split.
    pub const ONE: Grid = Grid { rows: 1, cols: 1 };

    /// R·C: the ranks a sample is spread over.
    pub fn tiles(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether samples are split at all.
    pub fn is_split(&self) -> bool {
        self.tiles() > 1
    }

    /// Whether a value of per-sample shape `s` is split into tiles: a C×H×W map with at
    /// least a row and a column for every tile. Anything else (a vector of logits, a map
    /// smaller than the grid) is whole on every rank of the group.
    pub fn splits(&self, s: &Shape) -> bool {
        self.is_split() && matches!(s.dims(), [_, h, w] if *h >= self.rows && *w >= self.cols)
    }

    /// The rows and columns of an `h`×`w` map that tile `t` owns.
    pub fn owned(&self, t: usize, (h, w): (usize, usize)) -> Rect {
        let (r, c) = (t / self.cols, t % self.cols);
        Rect::new(part(r, self.rows, h), part(c, self.cols, w))
    }
}

impl Default for Grid {
    fn default() -> Self {
        Grid::ONE
    }
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.rows, self.cols)
    }
}

impl FromStr for Grid {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("'{s}' is not a grid of tiles: expected RxC, e.g. 2x2 or 1x4");
        let (r, c) = s.split_once(['x', 'X']).ok_or_else(bad)?;
        let (rows, cols): (usize, usize) = (
            r.trim().parse().map_err(|_| bad())?,
            c.trim().parse().map_err(|_| bad())?,
        );
        // Checked: sides such as 2^32 would wrap their product to 0 tiles.
        if rows == 0 || cols == 0 || rows.checked_mul(cols).is_none_or(|t| t > 4096) {
            return Err(format!(
                "a grid of {rows}x{cols} tiles: each side from 1, at most 4096 tiles"
            ));
        }
        Ok(Grid { rows, cols })
    }
}

/// Part `i` of `n` of `0..len`: [⌊i·len/n⌋, ⌊(i+1)·len/n⌋), so parts differ by at most one.
pub fn part(i: usize, n: usize, len: usize) -> Range<usize> {
    i * len / n..(i + 1) * len / n
}

/// Rows × columns of a map, in the map's coordinates; may reach outside the map (padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    /// First and one-past-last row.
    pub rows: (isize, isize),
    /// First and one-past-last column.
    pub cols: (isize, isize),
}

impl Rect {
    /// The rectangle of these rows and columns.
    pub fn new(rows: Range<usize>, cols: Range<usize>) -> Rect {
        Rect {
            rows: (rows.start as isize, rows.end as isize),
            cols: (cols.start as isize, cols.end as isize),
        }
    }

    /// (height, width).
    pub fn size(&self) -> (usize, usize) {
        (
            (self.rows.1 - self.rows.0).max(0) as usize,
            (self.cols.1 - self.cols.0).max(0) as usize,
        )
    }

    /// Whether it holds no pixel.
    pub fn is_empty(&self) -> bool {
        self.rows.1 <= self.rows.0 || self.cols.1 <= self.cols.0
    }

    /// The rows and columns in both.
    pub fn meet(&self, o: &Rect) -> Rect {
        Rect {
            rows: (self.rows.0.max(o.rows.0), self.rows.1.min(o.rows.1)),
            cols: (self.cols.0.max(o.cols.0), self.cols.1.min(o.cols.1)),
        }
    }

    /// The rectangle as the backend's window of its map (it lies inside the map).
    pub fn window(&self) -> MapWindow {
        let (h, w) = self.size();
        MapWindow {
            row: self.rows.0.max(0) as usize,
            col: self.cols.0.max(0) as usize,
            h,
            w,
        }
    }

    /// Whether it lies inside an `h`×`w` map.
    fn inside(&self, (h, w): (usize, usize)) -> bool {
        self.rows.0 >= 0
            && self.cols.0 >= 0
            && self.rows.1 <= h as isize
            && self.cols.1 <= w as isize
    }
}

/// A rank's place in its tile group: the group (rank t holds tile t) and the grid.
pub struct Tiles {
    /// The ranks holding the tiles of the same samples, rank t holding tile t.
    pub comm: Box<dyn Comm>,
    /// How the samples are split.
    pub grid: Grid,
    /// Seconds spent waiting for halos (and their gradients) since [`Tiles::take_waited`].
    waited: Cell<f64>,
}

impl Tiles {
    /// Tile `comm.rank()` of `grid` in the group `comm`.
    pub fn new(comm: Box<dyn Comm>, grid: Grid) -> Tiles {
        Tiles {
            comm,
            grid,
            waited: Cell::new(0.0),
        }
    }

    /// Seconds this rank waited for halo pieces since the last call: the exchange's cost that
    /// computing did not hide.
    pub fn take_waited(&self) -> f64 {
        self.waited.take()
    }

    /// A piece from rank `q`, its wait counted.
    fn receive(&self, d: &Device, q: usize, tag: u64) -> Result<Tensor> {
        let start = Instant::now();
        let piece = self.comm.recv(q, tag, d, Category::Communication);
        self.waited
            .set(self.waited.get() + start.elapsed().as_secs_f64());
        piece
    }

    /// This rank's tile.
    pub fn tile(&self) -> usize {
        self.comm.rank()
    }

    /// The part of an `h`×`w` map this rank owns.
    pub fn own(&self, hw: (usize, usize)) -> Rect {
        self.grid.owned(self.tile(), hw)
    }

    /// Sums per-rank host numbers over the group, added in tile order (the same bits on every
    /// rank).
    pub fn sum(&self, v: Vec<f64>) -> Result<Vec<f64>> {
        self.comm.sum_f64(v)
    }
}

/// What an op running on tiles is told about the whole maps.
pub struct OnTiles<'a> {
    /// The tile group.
    pub tiles: &'a Tiles,
    /// Per-sample shapes of the whole inputs.
    pub inputs: Vec<&'a Shape>,
    /// Per-sample shape of the whole output.
    pub output: &'a Shape,
}

impl OnTiles<'_> {
    /// (H, W) of whole input `i`.
    pub fn input_hw(&self, i: usize) -> (usize, usize) {
        let d = self.inputs[i].dims();
        (d[1], d[2])
    }
    /// (H, W) of the whole output.
    pub fn output_hw(&self) -> (usize, usize) {
        let d = self.output.dims();
        (d[1], d[2])
    }
}

/// How an op runs on tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileRule {
    /// Each output pixel from the same pixel of the inputs (ReLU, add, concatenation): as it
    /// is, on each tile.
    Pointwise,
    /// The op runs on tiles itself (`Ctx::tiles`): a tile of output from tiles of input.
    Tiled,
    /// The op reduces tiles to a whole value on every rank (global pooling), itself.
    Reduces,
    /// The op needs its inputs whole: they are gathered onto every rank of the group first,
    /// and it runs the same on each.
    Whole,
}

/// Tags of the group's messages: every rank of a group runs the same ops in the same order,
/// and messages of one tag between two ranks arrive in order.
const GATHER_TAG: u64 = 1;
const SCATTER_TAG: u64 = 2;

/// Copies the `r` rectangle (map coordinates) of `src` (whose planes hold `from` of a map)
/// into `dst` (whose planes hold `to`), over all n·c planes.
fn copy_rect(
    d: &Device,
    src: &Tensor,
    from: &Rect,
    dst: &mut Tensor,
    to: &Rect,
    r: &Rect,
) -> Result<()> {
    let (n, c, sh, sw) = src.shape().nchw();
    let (_, _, dh, dw) = dst.shape().nchw();
    debug_assert_eq!((sh, sw), from.size());
    debug_assert_eq!((dh, dw), to.size());
    let (rows, cols) = r.size();
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let at = |outer: &Rect, w: usize, row: isize| {
        ((row - outer.rows.0) as usize) * w + (r.cols.0 - outer.cols.0) as usize
    };
    let be = d.backend();
    if cols == sw && cols == dw {
        // Whole rows in both: one strided copy.
        return be.copy_channels(
            src.storage(),
            dst.storage_mut()?,
            (sh * sw, at(from, sw, r.rows.0)),
            (dh * dw, at(to, dw, r.rows.0)),
            rows * cols,
            n * c,
            1,
        );
    }
    for row in r.rows.0..r.rows.1 {
        be.copy_channels(
            src.storage(),
            dst.storage_mut()?,
            (sh * sw, at(from, sw, row)),
            (dh * dw, at(to, dw, row)),
            cols,
            n * c,
            1,
        )?;
    }
    Ok(())
}

/// The `r` part of `src` (holding `from`) as a tensor of its own.
fn extract(d: &Device, src: &Tensor, from: &Rect, r: &Rect) -> Result<Tensor> {
    let (n, c, _, _) = src.shape().nchw();
    let (h, w) = r.size();
    let mut out = d.empty(
        Shape::new([n, c, h, w]),
        src.dtype(),
        Category::Communication,
    )?;
    copy_rect(d, src, from, &mut out, r, r)?;
    Ok(out)
}

/// The `r` part of `x` (which holds `from`) as an activation of its own.
pub fn within(d: &Device, x: &Tensor, from: &Rect, r: &Rect) -> Result<Tensor> {
    let (n, c, _, _) = x.shape().nchw();
    let (h, w) = r.size();
    let mut out = d.empty(Shape::new([n, c, h, w]), x.dtype(), Category::Activations)?;
    copy_rect(d, x, from, &mut out, r, r)?;
    Ok(out)
}

/// `x` (which holds `at`) inside the larger rectangle `into`, zeros elsewhere.
pub fn embed(d: &Device, x: &Tensor, at: &Rect, into: &Rect) -> Result<Tensor> {
    let (n, c, _, _) = x.shape().nchw();
    let (h, w) = into.size();
    let mut out = d.zeros(Shape::new([n, c, h, w]), x.dtype(), Category::Activations)?;
    copy_rect(d, x, at, &mut out, into, at)?;
    Ok(out)
}

/// Tile `t` of a whole map `x` split by `grid`.
pub fn cut(d: &Device, x: &Tensor, grid: Grid, t: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.shape().nchw();
    let (whole, own) = (Rect::new(0..h, 0..w), grid.owned(t, (h, w)));
    if own == whole {
        return Ok(x.clone());
    }
    extract(d, x, &whole, &own)
}

/// The whole `hw` map from its tiles, in tile order.
pub fn assemble(d: &Device, tiles: &[Tensor], grid: Grid, hw: (usize, usize)) -> Result<Tensor> {
    let parts: Vec<_> = (0..tiles.len())
        .map(|t| (grid.owned(t, hw), tiles[t].clone()))
        .collect();
    join(d, &parts, &Rect::new(0..hw.0, 0..hw.1))
}

/// The `into` rectangle of a map from parts that cover it, each with the rectangle it holds.
pub fn join(d: &Device, parts: &[(Rect, Tensor)], into: &Rect) -> Result<Tensor> {
    let first = &parts[0].1;
    let (n, c, _, _) = first.shape().nchw();
    let (h, w) = into.size();
    let mut out = d.empty(
        Shape::new([n, c, h, w]),
        first.dtype(),
        Category::Activations,
    )?;
    for (at, x) in parts {
        copy_rect(d, x, at, &mut out, into, at)?;
    }
    Ok(out)
}

/// The parts of a map a rank needs beyond its own tile, from the ranks that own them. The
/// exchange comes in two halves, [`Halo::send`] and [`Halo::receive`], so that work needing
/// only the own tile can run while the pieces travel. `needs` holds every rank's rectangle
/// (each rank computes them all, the same), so each rank knows what to send without asking.
pub struct Halo {
    /// The map's size, this rank's tile of it, and the rectangle it needs.
    hw: (usize, usize),
    own: Rect,
    need: Rect,
    /// What the other ranks sent, in rank order, with the rectangle each covers.
    pieces: Vec<(Rect, Tensor)>,
}

impl Halo {
    /// Sends the parts of this rank's tile `x` (of a map of size `hw`) that the other ranks'
    /// rectangles cover.
    pub fn send(
        ctx: &Ctx,
        t: &Tiles,
        x: &Tensor,
        hw: (usize, usize),
        needs: &[Rect],
    ) -> Result<Halo> {
        let me = t.tile();
        let own = t.own(hw);
        for (q, theirs) in needs.iter().enumerate().filter(|&(q, _)| q != me) {
            let r = own.meet(theirs);
            if !r.is_empty() {
                t.comm
                    .send(&extract(ctx.device, x, &own, &r)?, q, GATHER_TAG)?;
            }
        }
        Ok(Halo {
            hw,
            own,
            need: needs[me],
            pieces: Vec::new(),
        })
    }

    /// The rectangles of `need` the other ranks own, in rank order (what they send).
    fn incoming(&self, t: &Tiles) -> impl Iterator<Item = (usize, Rect)> + '_ {
        let grid = t.grid;
        let (me, hw, need) = (t.tile(), self.hw, self.need);
        (0..grid.tiles())
            .filter(move |&q| q != me)
            .map(move |q| (q, grid.owned(q, hw).meet(&need)))
            .filter(|(_, r)| !r.is_empty())
    }

    /// Waits for the pieces of the needed rectangle that other ranks own.
    pub fn receive(&mut self, ctx: &Ctx, t: &Tiles) -> Result<()> {
        let incoming: Vec<_> = self.incoming(t).collect();
        for (q, r) in incoming {
            let piece = t.receive(ctx.device, q, GATHER_TAG)?;
            self.pieces.push((r, piece));
        }
        Ok(())
    }

    /// The received pieces, to keep for backward ([`Halo::received`] takes them back).
    pub fn into_pieces(self) -> Vec<Tensor> {
        self.pieces.into_iter().map(|(_, p)| p).collect()
    }

    /// The halo of a finished exchange from its pieces ([`Halo::into_pieces`]).
    pub fn received(t: &Tiles, hw: (usize, usize), needs: &[Rect], pieces: Vec<Tensor>) -> Halo {
        let mut h = Halo {
            hw,
            own: t.own(hw),
            need: needs[t.tile()],
            pieces: Vec::new(),
        };
        let rects: Vec<_> = h.incoming(t).map(|(_, r)| r).collect();
        h.pieces = rects.into_iter().zip(pieces).collect();
        h
    }

    /// The part `r` of the map (within the needed rectangle), from this rank's tile `x` and
    /// the pieces received; zeros where `r` lies outside the map. `x` itself where `r` is the
    /// own tile.
    pub fn region(&self, ctx: &Ctx, x: &Tensor, r: &Rect) -> Result<Tensor> {
        if *r == self.own {
            return Ok(x.clone());
        }
        let (n, c, _, _) = x.shape().nchw();
        let (h, w) = r.size();
        let shape = Shape::new([n, c, h, w]);
        let mut buf = match r.inside(self.hw) {
            true => ctx.output(shape, x)?,
            false => ctx.activation(shape, x)?,
        };
        copy_rect(ctx.device, x, &self.own, &mut buf, r, &self.own.meet(r))?;
        for (from, piece) in &self.pieces {
            copy_rect(ctx.device, piece, from, &mut buf, r, &from.meet(r))?;
        }
        Ok(buf)
    }

    /// A tensor holding the part `r` of the map and the rectangle it holds: `x` itself (its
    /// tile) where `r` lies inside the tile and starts at its corner, so that a window op
    /// given explicit output sizes reads `r` from it without a copy; else [`Halo::region`].
    pub fn source(&self, ctx: &Ctx, x: &Tensor, r: &Rect) -> Result<(Tensor, Rect)> {
        let own = self.own;
        if own.meet(r) == *r && (r.rows.0, r.cols.0) == (own.rows.0, own.cols.0) {
            return Ok((x.clone(), own));
        }
        Ok((self.region(ctx, x, r)?, *r))
    }
}

/// This rank's `needs[me]` of a map of size `hw` split over the group, from its own tile `x`
/// and the parts the other ranks own (zeros where the rectangle lies outside the map).
pub fn gather(
    ctx: &Ctx,
    t: &Tiles,
    x: &Tensor,
    hw: (usize, usize),
    needs: &[Rect],
) -> Result<Tensor> {
    let mut halo = Halo::send(ctx, t, x, hw, needs)?;
    halo.receive(ctx, t)?;
    halo.region(ctx, x, &needs[t.tile()])
}

/// A window op's output tile, the halo exchange overlapped with the interior: this tile's
/// border goes to the ranks that read it (`needs`, every rank's input rectangle), the
/// outputs whose windows (`stride`, `pad`, `span`) read only the tile are computed while the
/// halo travels, then the rest, in up to four strips. `rect(halo, out)` computes output
/// rectangle `out` from the input tile `x` and what `halo` holds (nothing yet for the
/// interior). Returns the output tile and the halo's pieces (for [`Halo::received`]).
#[allow(clippy::too_many_arguments)]
pub fn overlapped(
    ctx: &Ctx,
    t: &OnTiles,
    x: &Tensor,
    needs: &[Rect],
    stride: (usize, usize),
    pad: (usize, usize),
    span: (usize, usize),
    mut rect: impl FnMut(&Halo, &Rect) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let hw = t.input_hw(0);
    let mut halo = Halo::send(ctx, t.tiles, x, hw, needs)?;
    let out = t.tiles.own(t.output_hw());
    let inner = interior(&out, &t.tiles.own(hw), hw, stride, pad, span);
    let mut parts = Vec::with_capacity(5);
    if !inner.is_empty() {
        parts.push((inner, rect(&halo, &inner)?));
    }
    halo.receive(ctx, t.tiles)?;
    for r in around(&out, &inner) {
        let y = rect(&halo, &r)?;
        parts.push((r, y));
    }
    let y = match parts.len() {
        1 => parts.pop().expect("one part").1,
        _ => join(ctx.device, &parts, &out)?,
    };
    Ok((y, halo.into_pieces()))
}

/// Halo gradients on their way back to the ranks that own those pixels (the first half of
/// [`scatter_add`]): what this rank keeps is its own tile's part.
pub struct Returning {
    own: Rect,
    /// The gradient of the own tile, before the others' parts are added.
    dx: Tensor,
}

impl Returning {
    /// Sends the parts of `dbuf` (the gradient of this rank's needed rectangle) that other
    /// ranks own to them.
    pub fn send(
        ctx: &Ctx,
        t: &Tiles,
        dbuf: Tensor,
        hw: (usize, usize),
        needs: &[Rect],
    ) -> Result<Returning> {
        let me = t.tile();
        let own = t.own(hw);
        let need = needs[me];
        for q in (0..needs.len()).filter(|&q| q != me) {
            let r = t.grid.owned(q, hw).meet(&need);
            if !r.is_empty() {
                t.comm
                    .send(&extract(ctx.device, &dbuf, &need, &r)?, q, SCATTER_TAG)?;
            }
        }
        let dx = if need == own {
            dbuf
        } else {
            let (n, c, _, _) = dbuf.shape().nchw();
            let (h, w) = own.size();
            let mut dx = ctx.activation(Shape::new([n, c, h, w]), &dbuf)?;
            copy_rect(ctx.device, &dbuf, &need, &mut dx, &own, &own.meet(&need))?;
            dx
        };
        Ok(Returning { own, dx })
    }

    /// Adds what the other ranks return of this rank's tile, in rank order: its gradient.
    pub fn add_received(self, ctx: &Ctx, t: &Tiles, needs: &[Rect]) -> Result<Tensor> {
        let Returning { own, mut dx } = self;
        for (q, theirs) in needs.iter().enumerate().filter(|&(q, _)| q != t.tile()) {
            let r = own.meet(theirs);
            if !r.is_empty() {
                let piece = t.receive(ctx.device, q, SCATTER_TAG)?;
                let mut sum = extract(ctx.device, &dx, &own, &r)?;
                ctx.device
                    .backend()
                    .add_assign(sum.storage_mut()?, piece.storage())?;
                copy_rect(ctx.device, &sum, &r, &mut dx, &own, &r)?;
            }
        }
        Ok(dx)
    }
}

/// The adjoint of [`gather`]: from the gradient of this rank's gathered rectangle, the
/// gradient of its own tile. The parts other ranks own go back to them; each rank adds what it
/// receives to its own part, in rank order.
pub fn scatter_add(
    ctx: &Ctx,
    t: &Tiles,
    dbuf: Tensor,
    hw: (usize, usize),
    needs: &[Rect],
) -> Result<Tensor> {
    Returning::send(ctx, t, dbuf, hw, needs)?.add_received(ctx, t, needs)
}

/// The whole map (of size `hw`) on every rank, from each rank's tile `x`.
pub fn all_gather(ctx: &Ctx, t: &Tiles, x: &Tensor, hw: (usize, usize)) -> Result<Tensor> {
    let whole = Rect::new(0..hw.0, 0..hw.1);
    gather(ctx, t, x, hw, &vec![whole; t.grid.tiles()])
}

/// This rank's tile of a whole map `x` (the same on every rank): no messages.
pub fn crop(ctx: &Ctx, t: &Tiles, x: &Tensor) -> Result<Tensor> {
    cut(ctx.device, x, t.grid, t.tile())
}

/// The rows (or columns) a window op's outputs `out` read of an input of length `len`, in input
/// coordinates before clipping: output o reads o·stride − pad + [0, span).
pub fn window_rows(out: (isize, isize), stride: usize, pad: usize, span: usize) -> (isize, isize) {
    let (s, p) = (stride as isize, pad as isize);
    (out.0 * s - p, (out.1 - 1) * s - p + span as isize)
}

/// The input rectangle the windows of output rectangle `out` read, for a window op whose
/// whole input is `input`: clipped to the map (`clip`: `true`) or to the map and its padding
/// (`false`, for a pool that counts padding).
pub fn window_rect(
    out: &Rect,
    input: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    span: (usize, usize),
    clip: bool,
) -> Rect {
    let rows = window_rows(out.rows, stride.0, pad.0, span.0);
    let cols = window_rows(out.cols, stride.1, pad.1, span.1);
    let (lo, hi) = match clip {
        true => ((0, 0), (input.0 as isize, input.1 as isize)),
        false => (
            (-(pad.0 as isize), -(pad.1 as isize)),
            ((input.0 + pad.0) as isize, (input.1 + pad.1) as isize),
        ),
    };
    Rect {
        rows: (rows.0.max(lo.0), rows.1.min(hi.0)),
        cols: (cols.0.max(lo.1), cols.1.min(hi.1)),
    }
}

/// The rows (or columns) of an input of length `len` that a transposed convolution's outputs
/// `out` take from: input i adds into outputs i·stride − pad + [0, kernel). Never empty for an
/// output inside the map.
pub fn transposed_rows(
    out: (isize, isize),
    stride: usize,
    pad: usize,
    kernel: usize,
    len: usize,
) -> (isize, isize) {
    let (s, p, k) = (stride as isize, pad as isize, kernel as isize);
    let first = (out.0 + p - (k - 1)).div_euclid(s).max(0);
    let end = ((out.1 - 1 + p).div_euclid(s) + 1).min(len as isize);
    (first, end)
}

/// The rows (or columns) of an adaptive average pool from `len` to `out_len` that output
/// rows `out` read, and the output rows those input rows make on their own: `out` widened to
/// whole periods of the pool's pattern (`out_len`/g outputs from `len`/g inputs, g their
/// greatest common divisor), where the pool over just those input rows computes the same
/// windows as over the whole map. One period is the whole map when the sizes share no
/// factor.
pub fn adaptive_rows(
    out: (isize, isize),
    len: usize,
    out_len: usize,
) -> ((isize, isize), (isize, isize)) {
    let g = num_integer::gcd(len, out_len) as isize;
    let (period_out, period_in) = (out_len as isize / g, len as isize / g);
    let (first, end) = (out.0 / period_out, (out.1 + period_out - 1) / period_out);
    (
        (first * period_in, end * period_in),
        (first * period_out, end * period_out),
    )
}

/// Every rank's input rectangle for a window op whose whole input is `input` and output
/// `output`: what the windows of its output tile read ([`window_rect`]).
pub fn window_needs(
    grid: Grid,
    input: (usize, usize),
    output: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    span: (usize, usize),
    clip: bool,
) -> Vec<Rect> {
    (0..grid.tiles())
        .map(|t| window_rect(&grid.owned(t, output), input, stride, pad, span, clip))
        .collect()
}

/// The part of output rectangle `out` whose windows (clipped to the `input` map) read only
/// the input rectangle `own`: what a tile can compute before its halo arrives. Empty where
/// every window reaches beyond `own`.
pub fn interior(
    out: &Rect,
    own: &Rect,
    input: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    span: (usize, usize),
) -> Rect {
    // Per axis: windows start and end no earlier as the output index grows, so the outputs
    // reading inside `own` are one range.
    let axis = |out: (isize, isize), own: (isize, isize), len: usize, s, p, k| {
        let reads = |o: isize| {
            let (lo, hi) = window_rows((o, o + 1), s, p, k);
            (lo.max(0), hi.min(len as isize))
        };
        let first = (out.0..out.1)
            .find(|&o| reads(o).0 >= own.0)
            .unwrap_or(out.1);
        let end = (first..out.1)
            .rev()
            .find(|&o| reads(o).1 <= own.1)
            .map_or(first, |o| o + 1);
        (first, end)
    };
    Rect {
        rows: axis(out.rows, own.rows, input.0, stride.0, pad.0, span.0),
        cols: axis(out.cols, own.cols, input.1, stride.1, pad.1, span.1),
    }
}

/// Rectangle `out` less `inner` (which lies inside it): the rows above and below `inner`,
/// then the columns left and right of it; `out` itself where `inner` is empty.
pub fn around(out: &Rect, inner: &Rect) -> Vec<Rect> {
    if inner.is_empty() {
        return vec![*out];
    }
    [
        Rect {
            rows: (out.rows.0, inner.rows.0),
            cols: out.cols,
        },
        Rect {
            rows: (inner.rows.1, out.rows.1),
            cols: out.cols,
        },
        Rect {
            rows: inner.rows,
            cols: (out.cols.0, inner.cols.0),
        },
        Rect {
            rows: inner.rows,
            cols: (inner.cols.1, out.cols.1),
        },
    ]
    .into_iter()
    .filter(|r| !r.is_empty())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_axis_and_differ_by_at_most_one() {
        for len in 1..40 {
            for n in 1..=len.min(7) {
                let parts: Vec<_> = (0..n).map(|i| part(i, n, len)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[n - 1].end, len);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
                let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(hi - lo <= 1, "{sizes:?}");
            }
        }
    }

    /// The interior reads only the own tile and is the largest part of the output tile that
    /// does; with the strips around it, it covers the output tile once. For convolutions, and
    /// for pools in ceil mode, whose last window may run past the padded map.
    #[test]
    fn interior_and_strips_cover_the_output_tile() {
        for side in [5usize, 9, 16, 17] {
            for (k, s, p, d, ceil) in [
                (3, 1, 1, 1, false),
                (1, 1, 0, 1, false),
                (3, 2, 1, 1, false),
                (7, 2, 3, 1, false),
                (3, 1, 2, 2, false),
                (2, 2, 0, 1, false),
                (3, 2, 1, 1, true),
                (3, 2, 0, 1, true),
                (2, 2, 0, 1, true),
            ] {
                let span = d * (k - 1) + 1;
                let out_len = match ceil {
                    false => (side + 2 * p - span) / s + 1,
                    // PyTorch's rule: the last window starts inside the map or its left padding.
                    true => {
                        let out = (side + 2 * p - span).div_ceil(s) + 1;
                        out - usize::from((out - 1) * s >= side + p)
                    }
                };
                for grid in [
                    Grid { rows: 1, cols: 2 },
                    Grid { rows: 2, cols: 2 },
                    Grid { rows: 3, cols: 1 },
                ] {
                    for t in 0..grid.tiles() {
                        let (input, output) = ((side, side), (out_len, out_len));
                        let (out, own) = (grid.owned(t, output), grid.owned(t, input));
                        let inner = interior(&out, &own, input, (s, s), (p, p), (span, span));
                        let read =
                            |r: &Rect| window_rect(r, input, (s, s), (p, p), (span, span), true);
                        if !inner.is_empty() {
                            assert_eq!(out.meet(&inner), inner);
                            assert_eq!(
                                own.meet(&read(&inner)),
                                read(&inner),
                                "{side} {k} {s} {p} {t}"
                            );
                        }
                        let mut seen = vec![0; out.size().0 * out.size().1];
                        let parts = [vec![inner], around(&out, &inner)].concat();
                        for r in parts.iter().filter(|r| !r.is_empty()) {
                            for row in r.rows.0..r.rows.1 {
                                for col in r.cols.0..r.cols.1 {
                                    let i = (row - out.rows.0) as usize * out.size().1
                                        + (col - out.cols.0) as usize;
                                    seen[i] += 1;
                                    let one = Rect {
                                        rows: (row, row + 1),
                                        cols: (col, col + 1),
                                    };
                                    // Every output outside the interior reads beyond the tile.
                                    let inside = inner.meet(&one) == one;
                                    assert_eq!(inside, own.meet(&read(&one)) == read(&one));
                                }
                            }
                        }
                        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
                    }
                }
            }
        }
    }

    /// A transposed convolution's tile reads every input row that adds into it, and its first
    /// row adds no later than the tile's first output row (the adjoint's padding is ≥ 0).
    #[test]
    fn transposed_rows_hold_every_input_that_adds_into_the_tile() {
        for len in 1usize..12 {
            for (k, s, p) in [
                (2, 2, 0),
                (3, 2, 1),
                (4, 2, 1),
                (2, 3, 0),
                (5, 1, 2),
                (1, 2, 0),
            ] {
                let Some(out_len) = ((len - 1) * s + k).checked_sub(2 * p) else {
                    continue;
                };
                for o0 in 0..out_len {
                    for o1 in o0 + 1..=out_len {
                        let (first, end) =
                            transposed_rows((o0 as isize, o1 as isize), s, p, k, len);
                        assert!(0 <= first && first < end && end <= len as isize);
                        assert!(first * s as isize <= o0 as isize + p as isize);
                        for i in 0..len as isize {
                            let adds = (0..k as isize).any(|t| {
                                (o0 as isize..o1 as isize)
                                    .contains(&(i * s as isize - p as isize + t))
                            });
                            assert!(
                                !adds || (first..end).contains(&i),
                                "{len} {k} {s} {p} {o0} {o1} {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// An adaptive pool over the input rows of whole periods computes the whole map's windows
    /// for every output row of those periods, which hold the tile's.
    #[test]
    fn adaptive_rows_compute_the_whole_maps_windows() {
        use crate::backend::PoolGeom;
        for len in 1..14 {
            for out_len in 1..30 {
                for o0 in 0..out_len {
                    for o1 in o0 + 1..=out_len {
                        let (rows, wide) = adaptive_rows((o0 as isize, o1 as isize), len, out_len);
                        assert!(0 <= wide.0 && wide.0 <= o0 as isize && o1 as isize <= wide.1);
                        assert!(
                            wide.1 <= out_len as isize && 0 <= rows.0 && rows.1 <= len as isize
                        );
                        let (n, m) = ((rows.1 - rows.0) as usize, (wide.1 - wide.0) as usize);
                        for o in wide.0..wide.1 {
                            let local = PoolGeom::adaptive_window((o - wide.0) as usize, n, m);
                            let whole = PoolGeom::adaptive_window(o as usize, len, out_len);
                            let at = rows.0 as usize;
                            assert_eq!(
                                local.start + at..local.end + at,
                                whole,
                                "{len} {out_len} {o}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn grids_parse_and_refuse() {
        assert_eq!("2x3".parse::<Grid>().unwrap(), Grid { rows: 2, cols: 3 });
        assert!("0x2".parse::<Grid>().is_err());
        assert!("2".parse::<Grid>().is_err());
        assert!("axb".parse::<Grid>().is_err());
    }
}
