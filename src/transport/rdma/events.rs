//! The completion channel of a connection's queue pairs, registered with tokio.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::task::{Context, Poll};

use sideway::ibverbs::completion::CompletionChannel;
use tokio::io::unix::AsyncFd;

use super::verbs::{verbs, RdmaDevice, RdmaError};

/// The completion channel of one connection's queue pairs, registered with tokio: a driver
/// waits on its file descriptor instead of spinning (`AsyncFd`), after arming each queue
/// pair's completion queue ([`RcLink::arm`](super::link::RcLink::arm)).
pub struct EventChannel {
    // Declared first: deregistered from the reactor before the channel is destroyed (the
    // completion queues hold the channel too, so it outlives them).
    fd: AsyncFd<ChannelFd>,
    pub(super) channel: Arc<CompletionChannel>,
}

/// The raw descriptor of a completion channel, for tokio's reactor.
struct ChannelFd(RawFd);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd.get_ref().0)
            .finish()
    }
}

impl EventChannel {
    /// A non-blocking completion channel on `dev`, registered with the current tokio runtime.
    pub fn new(dev: &RdmaDevice) -> Result<Self, RdmaError> {
        let channel = CompletionChannel::new(&dev.ctx).map_err(verbs("ibv_create_comp_channel"))?;
        channel
            .set_nonblocking(true)
            .map_err(verbs("fcntl(O_NONBLOCK)"))?;
        let fd = AsyncFd::new(ChannelFd(channel.as_raw_fd())).map_err(verbs("AsyncFd::new"))?;
        Ok(Self { fd, channel })
    }

    /// Waits until the channel has events, takes and acknowledges them all. `Ready` means
    /// some completion queue has completions to poll (and must be armed again).
    pub fn poll_events(&self, cx: &mut Context<'_>) -> Poll<Result<(), RdmaError>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(RdmaError::Verbs {
                        call: "poll_read_ready",
                        detail: e.to_string(),
                    }))
                }
                Poll::Pending => return Poll::Pending,
            };
            let mut any = false;
            loop {
                let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
                let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
                // SAFETY: the channel is live (held by self); the fd is non-blocking, so this
                // returns -1 (EAGAIN) when no event is queued instead of blocking.
                let rc = unsafe {
                    rdma_mummy_sys::ibv_get_cq_event(
                        self.channel.comp_channel().as_ptr(),
                        &mut cq,
                        &mut ctx,
                    )
                };
                if rc != 0 || cq.is_null() {
                    break;
                }
                any = true;
                // SAFETY: `cq` is the live CQ the event belongs to (our CQs outlive the
                // channel's events: every event is acknowledged here, before any CQ drops).
                unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
            }
            if any {
                return Poll::Ready(Ok(()));
            }
            guard.clear_ready();
        }
    }
}

impl RdmaDevice {
    /// A completion channel for one connection's queue pairs.
    pub fn event_channel(&self) -> Result<EventChannel, RdmaError> {
        EventChannel::new(self)
    }
}
