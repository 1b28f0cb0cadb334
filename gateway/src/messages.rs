//! A bound on the gRPC messages of the gateway's batch calls held at once.
//!
//! tonic reads and decodes a unary call's whole request message before the
//! handler runs, and an answer sits whole in memory until the caller has
//! read it. Each call whose messages carry blobs — `BatchUpdateBlobs`,
//! `BatchReadBlobs`, `UpdateActionResult` — takes room for a message of
//! the largest size accepted before its request is read, and keeps it
//! until its answer has been sent or the call ends: a crowd of such calls
//! (hundreds of build machines uploading their small outputs at once, or
//! clients that never read their answers) waits for room instead of
//! growing the gateway until it is killed, and past the call timeout fails
//! `UNAVAILABLE` (what REAPI clients retry). ByteStream and the HTTP
//! endpoints are bounded by the upload and read budgets instead (their
//! messages are small pieces). Not bounded here: `GetActionResult`, asked
//! once per action (its answer inlines outputs only when asked, up to a
//! batch's size), and `FindMissingBlobs` (digests only).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::server::NamedService;

/// The calls held to the budget.
const BOUNDED: [&str; 3] = [
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchUpdateBlobs",
    "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchReadBlobs",
    "/build.bazel.remote.execution.v2.ActionCache/UpdateActionResult",
];

/// Room for the messages of the bounded calls, shared by the services that
/// serve them.
#[derive(Debug)]
pub(crate) struct MessageBudget {
    /// KiB of room.
    room: Arc<Semaphore>,
    /// The budget, bytes.
    total: u64,
    /// KiB one call takes: its largest message.
    per_call: u32,
    /// How long a call waits for room.
    wait: Duration,
}

impl MessageBudget {
    /// `total` bytes of room, `per_call` bytes for each call (at least one
    /// call fits, whatever `total`), waiting at most `wait`.
    pub(crate) fn new(total: u64, per_call: u64, wait: Duration) -> Arc<MessageBudget> {
        let per_call = u32::try_from(per_call.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
        let kib = u32::try_from(total >> 10)
            .unwrap_or(u32::MAX)
            .clamp(per_call, Semaphore::MAX_PERMITS as u32);
        Arc::new(MessageBudget {
            room: Arc::new(Semaphore::new(kib as usize)),
            total,
            per_call: per_call.min(kib),
            wait,
        })
    }

    /// `service` with its bounded calls held to this budget.
    pub(crate) fn bound<S>(self: &Arc<Self>, service: S) -> Bounded<S> {
        Bounded {
            inner: service,
            budget: self.clone(),
        }
    }

    /// How many bounded calls the budget holds at once.
    #[cfg(test)]
    fn calls(&self) -> usize {
        (self.room.available_permits() / self.per_call as usize).max(1)
    }
}

/// A gRPC service whose bounded calls take room first.
#[derive(Clone, Debug)]
pub(crate) struct Bounded<S> {
    inner: S,
    budget: Arc<MessageBudget>,
}

impl<S: NamedService> NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Bounded<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if !BOUNDED.contains(&request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        // The service made ready goes with the call (a clone waits for
        // room first, then is called).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let budget = self.budget.clone();
        Box::pin(async move {
            let room = budget.room.clone().acquire_many_owned(budget.per_call);
            let held = match tokio::time::timeout(budget.wait, room).await {
                Ok(held) => held.expect("the budget is never closed"),
                Err(_) => {
                    let status = tonic::Status::unavailable(format!(
                        "the gateway's room for batch and action cache messages ({} MiB) stayed taken for {:?}; try again",
                        budget.total >> 20,
                        budget.wait
                    ));
                    return Ok(status.into_http());
                }
            };
            let response = inner.call(request).await?;
            Ok(response.map(|body| {
                Body::new(Holding {
                    body,
                    rest: Bytes::new(),
                    room: Some(held),
                })
            }))
        })
    }
}

/// Bytes of an answer handed to hyper at a time. hyper takes a whole
/// frame into its connection's send buffer once the stream has any window,
/// and tonic encodes a unary answer as one frame: handed whole, a client
/// that reads nothing left the answer in hyper's buffer, the room given
/// back.
const PIECE: usize = 64 << 10;

/// An answer's body, handed on in pieces, holding its call's room until
/// the last is taken (or the body is dropped).
struct Holding {
    body: Body,
    /// What is left of the data frame being handed on.
    rest: Bytes,
    room: Option<OwnedSemaphorePermit>,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if this.rest.is_empty() {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(None) => {
                    this.room = None;
                    return Poll::Ready(None);
                }
                other => return other,
            }
        }
        let piece = this.rest.split_to(this.rest.len().min(PIECE));
        Poll::Ready(Some(Ok(http_body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut hint = self.body.size_hint();
        let rest = self.rest.len() as u64;
        hint.set_lower(hint.lower().saturating_add(rest));
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_holds_whole_calls_and_at_least_one() {
        let budget = MessageBudget::new(256 << 20, 5 << 20, Duration::from_secs(1));
        assert_eq!(budget.calls(), 51);
        let small = MessageBudget::new(1 << 20, 5 << 20, Duration::from_secs(1));
        assert_eq!(small.calls(), 1, "a budget below one call still serves one");
        assert_eq!(small.per_call, 5 << 10);
    }
}
