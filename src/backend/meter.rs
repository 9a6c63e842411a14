//! The metering backend: allocates every tensor a run would (as `Storage::Virtual`, so the
//! allocator counts the bytes) and computes nothing. Running a scheme's real task lists on it
//! predicts each rank's memory by category exactly, for any image size, in milliseconds.
//! Workspace sizes are those of the backend it stands in for ([`ConvWorkspace`]).

use std::sync::{Arc, OnceLock};

use super::{
    AdamStep, Backend, ChannelGeom, ConvGeom, DeviceKind, Event, GroupGeom, LossGeom, MaskGeom,
    Nonlinearity, PoolGeom, ResizeGeom, SgdStep,
};
use crate::backend::host::HostPool;
use crate::backend::Storage;
use crate::core::DType;
use crate::Result;

/// Whose convolution workspace a metered run reserves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvWorkspace {
    /// The CPU backend's im2col tiles.
    Cpu,
    /// The native CUDA kernels' backward-filter partial sums on a GPU of this many
    /// multiprocessors. (cuDNN's workspace depends on the algorithms it times on the GPU, so a
    /// cuDNN run is predicted with the native kernels' workspace.)
    Cuda {
        /// The GPU's streaming multiprocessors.
        multiprocessors: u32,
    },
}

impl ConvWorkspace {
    /// The workspace of runs on `kind`: on a GPU, the first GPU's multiprocessor count as the
    /// driver reports it, or an H100's 132 where no GPU is visible (planning elsewhere).
    pub fn of(kind: DeviceKind) -> ConvWorkspace {
        static MULTIPROCESSORS: OnceLock<u32> = OnceLock::new();
        match kind {
            DeviceKind::Cpu => ConvWorkspace::Cpu,
            DeviceKind::Cuda { .. } => ConvWorkspace::Cuda {
                multiprocessors: *MULTIPROCESSORS.get_or_init(|| {
                    super::cuda::devices()
                        .ok()
                        .and_then(|g| g.first().map(|g| g.multiprocessors as u32))
                        .unwrap_or(132)
                }),
            },
        }
    }

    /// Workspace elements of a convolution of geometry `g`.
    pub fn elements(&self, g: &ConvGeom) -> usize {
        match *self {
            ConvWorkspace::Cpu => super::cpu::conv_workspace(g),
            ConvWorkspace::Cuda { multiprocessors } => {
                super::cuda::native_conv_workspace(g, multiprocessors)
            }
        }
    }
}

/// The metering backend: allocates the bytes every kernel would, computes nothing.
pub struct Meter {
    /// Whose convolution workspace it counts.
    pub workspace: ConvWorkspace,
}

impl Backend for Meter {
    fn name(&self) -> String {
        format!("meter ({:?} workspace)", self.workspace)
    }

    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage> {
        Ok(Storage::Virtual(dtype, numel))
    }

    fn empty(&self, numel: usize, dtype: DType) -> Result<Storage> {
        Ok(Storage::Virtual(dtype, numel))
    }

    fn upload(&self, data: &[f64], dtype: DType) -> Result<Storage> {
        Ok(Storage::Virtual(dtype, data.len()))
    }

    fn adopt(&self, s: Storage) -> Result<Storage> {
        Ok(Storage::Virtual(s.dtype(), s.len()))
    }

    fn host_zeros(&self, numel: usize, dtype: DType, _: Option<&Arc<HostPool>>) -> Result<Storage> {
        Ok(Storage::Virtual(dtype, numel))
    }

    fn copy_out(&self, _: &Storage, _: &mut Storage, _: bool) -> Result<Option<Event>> {
        Ok(None)
    }

    fn copy_in(&self, _: &Storage, _: &mut Storage, _: bool) -> Result<Option<Event>> {
        Ok(None)
    }

    fn wait(&self, _: &Event) -> Result<()> {
        Ok(())
    }

    fn copy(&self, _src: &Storage, _dst: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn conv2d_workspace(&self, g: &ConvGeom) -> usize {
        self.workspace.elements(g)
    }

    fn conv2d_forward(
        &self,
        _x: &Storage,
        _w: &Storage,
        _y: &mut Storage,
        _ws: &mut Storage,
        _g: &ConvGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn conv2d_backward_data(
        &self,
        _dy: &Storage,
        _w: &Storage,
        _dx: &mut Storage,
        _ws: &mut Storage,
        _g: &ConvGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn conv2d_backward_filter(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _dw: &mut Storage,
        _ws: &mut Storage,
        _g: &ConvGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn add_channel_bias(&self, _y: &mut Storage, _bias: &Storage, _g: &ChannelGeom) -> Result<()> {
        Ok(())
    }

    fn channel_sum(&self, _dy: &Storage, _db: &mut Storage, _g: &ChannelGeom) -> Result<()> {
        Ok(())
    }

    fn batchnorm_forward_train(
        &self,
        _x: &Storage,
        _gamma: &Storage,
        _beta: &Storage,
        _y: &mut Storage,
        _mean: &mut Storage,
        _var: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_forward_eval(
        &self,
        _x: &Storage,
        _gamma: &Storage,
        _beta: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _y: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_backward(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _gamma: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _dx: &mut Storage,
        _dgamma: &mut Storage,
        _dbeta: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_statistics(&self, _x: &Storage, g: &ChannelGeom) -> Result<Vec<(f64, f64)>> {
        Ok(vec![(0.0, 1.0); g.c])
    }

    fn batchnorm_backward_sums(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _relu_beta: Option<&Storage>,
        _gamma: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _eps: f64,
        g: &ChannelGeom,
    ) -> Result<Vec<(f64, f64)>> {
        Ok(vec![(0.0, 0.0); g.c])
    }

    fn batchnorm_backward_dx(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _relu_beta: Option<&Storage>,
        _gamma: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _sums: &[(f64, f64)],
        _count: usize,
        _dx: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_relu_forward_train(
        &self,
        _x: &Storage,
        _gamma: &Storage,
        _beta: &Storage,
        _y: &mut Storage,
        _mean: &mut Storage,
        _var: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_relu_backward(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _gamma: &Storage,
        _beta: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _dx: &mut Storage,
        _dgamma: &mut Storage,
        _dbeta: &mut Storage,
        _eps: f64,
        _g: &ChannelGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn batchnorm_update_running(
        &self,
        _running_mean: &mut Storage,
        _running_var: &mut Storage,
        _mean: &Storage,
        _var: &Storage,
        _momentum: f64,
        _count: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn groupnorm_forward(
        &self,
        _x: &Storage,
        _gamma: &Storage,
        _beta: &Storage,
        _y: &mut Storage,
        _mean: &mut Storage,
        _var: &mut Storage,
        _eps: f64,
        _g: &GroupGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn groupnorm_backward(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _gamma: &Storage,
        _mean: &Storage,
        _var: &Storage,
        _dx: &mut Storage,
        _dgamma: &mut Storage,
        _dbeta: &mut Storage,
        _eps: f64,
        _g: &GroupGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn nonlinearity_forward(&self, _f: Nonlinearity, _x: &Storage, _y: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn nonlinearity_backward(
        &self,
        _f: Nonlinearity,
        _x: &Storage,
        _dy: &Storage,
        _dx: &mut Storage,
    ) -> Result<()> {
        Ok(())
    }

    fn relu_forward(&self, _x: &Storage, _y: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn relu_backward(&self, _y: &Storage, _dy: &Storage, _dx: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn add(&self, _a: &Storage, _b: &Storage, _y: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn add_relu(&self, _a: &Storage, _b: &Storage, _y: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn add_assign(&self, _y: &mut Storage, _x: &Storage) -> Result<()> {
        Ok(())
    }

    fn mul(&self, _x: &Storage, _mask: &Storage, _y: &mut Storage) -> Result<()> {
        Ok(())
    }

    fn dropout_mask(&self, _mask: &mut Storage, _p: f64, _seed: u64, _g: &MaskGeom) -> Result<()> {
        Ok(())
    }

    fn max_pool_forward(&self, _x: &Storage, _y: &mut Storage, _g: &PoolGeom) -> Result<()> {
        Ok(())
    }

    fn max_pool_backward(
        &self,
        _x: &Storage,
        _dy: &Storage,
        _dx: &mut Storage,
        _g: &PoolGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn avg_pool_forward(&self, _x: &Storage, _y: &mut Storage, _g: &PoolGeom) -> Result<()> {
        Ok(())
    }

    fn avg_pool_backward(&self, _dy: &Storage, _dx: &mut Storage, _g: &PoolGeom) -> Result<()> {
        Ok(())
    }

    fn adaptive_avg_pool_forward(
        &self,
        _x: &Storage,
        _y: &mut Storage,
        _g: &PoolGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn adaptive_avg_pool_backward(
        &self,
        _dy: &Storage,
        _dx: &mut Storage,
        _g: &PoolGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn resize_bilinear_forward(
        &self,
        _x: &Storage,
        _y: &mut Storage,
        _g: &ResizeGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn resize_bilinear_backward(
        &self,
        _dy: &Storage,
        _dx: &mut Storage,
        _g: &ResizeGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn linear_forward(
        &self,
        _x: &Storage,
        _w: &Storage,
        _y: &mut Storage,
        _n: usize,
        _d_in: usize,
        _d_out: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn linear_backward(
        &self,
        _x: &Storage,
        _w: &Storage,
        _dy: &Storage,
        _dx: Option<&mut Storage>,
        _dw: &mut Storage,
        _n: usize,
        _d_in: usize,
        _d_out: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn copy_channels(
        &self,
        _src: &Storage,
        _dst: &mut Storage,
        _src_c: (usize, usize),
        _dst_c: (usize, usize),
        _count: usize,
        _n: usize,
        _hw: usize,
    ) -> Result<()> {
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        _logits: &Storage,
        _labels: &[u32],
        _weights: &[f64],
        _probs: &mut Storage,
        _g: &LossGeom,
    ) -> Result<f64> {
        Ok(0.0)
    }

    fn softmax_cross_entropy_backward(
        &self,
        _probs: &Storage,
        _labels: &[u32],
        _weights: &[f64],
        _dlogits: &mut Storage,
        _scale: f64,
        _g: &LossGeom,
    ) -> Result<()> {
        Ok(())
    }

    fn sgd_update(
        &self,
        _w: &mut Storage,
        _grad: &Storage,
        _momentum_buf: &mut Storage,
        _step: &SgdStep,
    ) -> Result<()> {
        Ok(())
    }

    fn adam_update(
        &self,
        _w: &mut Storage,
        _grad: &Storage,
        _exp_avg: &mut Storage,
        _exp_avg_sq: &mut Storage,
        _step: &AdamStep,
    ) -> Result<()> {
        Ok(())
    }

    fn fill(&self, _s: &mut Storage, _value: f64) -> Result<()> {
        Ok(())
    }

    fn all_finite(&self, _s: &Storage) -> Result<bool> {
        Ok(true)
    }
}
