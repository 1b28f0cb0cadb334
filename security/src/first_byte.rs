//! Server connections whose clients must say something first.
//!
//! An HTTP/2 server (every gRPC endpoint) waits for the client's preface
//! with no timeout of its own, and an HTTP/1 server under hyper's
//! automatic version detection reads the first bytes before its header
//! timeout applies: a client that connects (and completes its TLS
//! handshake) and then sends nothing held its connection and task for
//! ever. [`FirstByteDeadline`] wraps an accepted connection so that a read
//! fails with [`std::io::ErrorKind::TimedOut`] if the client's first
//! [`OPENING_BYTES`] did not arrive within its deadline; after them the
//! server's own timeouts (HTTP/1 header timeout, HTTP/2 keep-alive) take
//! over — or as soon as they stop matching HTTP/2's preface (an HTTP/1
//! request: hyper's version detection is done, and its header timeout
//! applies). Not the first byte alone: a client sending `P` and then
//! nothing stalled both HTTP/2's preface read and hyper's version
//! detection (a prefix of the preface), holding every connection slot for
//! ever.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// How long a gRPC client may take to send its first byte (its HTTP/2
/// preface, which a client sends as soon as it connects).
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/2's connection preface, which every gRPC client sends first and
/// after which hyper's HTTP/2 keep-alive applies; hyper reads as much of
/// it as matches to tell HTTP/1 from HTTP/2.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Bytes a client must send within the deadline, unless they stop
/// matching [`PREFACE`] earlier.
pub const OPENING_BYTES: usize = PREFACE.len();

/// An accepted connection that fails its reads once `timeout` passed
/// before the client's first [`OPENING_BYTES`] arrived (see the module
/// docs).
#[derive(Debug)]
pub struct FirstByteDeadline<I> {
    io: I,
    /// Until the opening bytes arrived.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Opening bytes still to come.
    awaited: usize,
    /// The server's connection slot this connection holds, if it counts
    /// them ([`crate::tls::grpc_incoming_plain`]): given back when the
    /// connection is dropped.
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<I> FirstByteDeadline<I> {
    /// Wraps `io`, accepted now, giving its client `timeout` to send its opening bytes.
    pub fn new(io: I, timeout: Duration) -> Self {
        FirstByteDeadline {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
            awaited: OPENING_BYTES,
            _slot: None,
        }
    }

    /// The connection, holding `slot` until it is dropped.
    pub fn holding(self, slot: tokio::sync::OwnedSemaphorePermit) -> Self {
        FirstByteDeadline {
            _slot: Some(slot),
            ..self
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &I {
        &self.io
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for FirstByteDeadline<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if self.deadline.is_some() {
                    let at = OPENING_BYTES - self.awaited;
                    let new = &buf.filled()[before..];
                    let wanted = &PREFACE[at..];
                    let compared = new.len().min(wanted.len());
                    let preface = new[..compared] == wanted[..compared];
                    self.awaited -= compared;
                    if self.awaited == 0 || !preface {
                        self.deadline = None;
                    }
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                let expired = self
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent nothing",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for FirstByteDeadline<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, data)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<I: tonic::transport::server::Connected> tonic::transport::server::Connected
    for FirstByteDeadline<I>
{
    type ConnectInfo = I::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn a_silent_client_times_out_and_one_that_spoke_does_not() {
        let (client, server) = tokio::io::duplex(64);
        let mut server = FirstByteDeadline::new(server, Duration::from_millis(200));
        let mut byte = [0u8; 1];
        let started = std::time::Instant::now();
        let error = server.read(&mut byte).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        drop(client);

        // One byte, then nothing (a prefix of HTTP/2's preface, on which
        // hyper's version detection and the preface read both wait): the
        // deadline still holds.
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = FirstByteDeadline::new(server, Duration::from_millis(200));
        client.write_all(b"P").await.unwrap();
        assert_eq!(server.read(&mut byte).await.unwrap(), 1);
        let error = server.read(&mut byte).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        // The whole preface, then silence: waits past the deadline (the
        // server's own timeouts apply from here).
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = FirstByteDeadline::new(server, Duration::from_millis(200));
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut preface = [0u8; OPENING_BYTES];
        server.read_exact(&mut preface).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(400), server.read(&mut byte)).await;
        assert!(waited.is_err(), "{waited:?}");
        // An HTTP/1 request shorter than the preface, then silence (its
        // answer being written): no longer a preface, so the server's own
        // timeouts apply, not this deadline.
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = FirstByteDeadline::new(server, Duration::from_millis(200));
        client.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let mut request = [0u8; 18];
        server.read_exact(&mut request).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(400), server.read(&mut byte)).await;
        assert!(waited.is_err(), "{waited:?}");
    }
}
