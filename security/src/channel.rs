//! Outgoing gRPC connections: through TLS when the process has it, with the
//! process's bearer token on every request when it has one.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::HeaderValue;
use tonic::body::Body;
use tonic::transport::Endpoint;

use crate::tls::{Connector, Tls};

/// What a process dials with.
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// TLS material; `None` dials plaintext (insecure mode).
    pub tls: Option<Arc<Tls>>,
    /// Bearer token sent with every request.
    pub token: Option<String>,
}

impl Security {
    /// Plaintext, no token.
    pub fn insecure() -> Self {
        Self::default()
    }

    /// An endpoint for `url`. With TLS the scheme may be `https` or `http`:
    /// the connection is TLS either way (the connector does it).
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, tonic::transport::Error> {
        let url = match (&self.tls, url.strip_prefix("https://")) {
            (Some(_), Some(rest)) => format!("http://{rest}"),
            _ => url.to_string(),
        };
        Endpoint::from_shared(url).map(|e| e.max_frame_size(crate::MAX_FRAME_BYTES))
    }

    /// Connects lazily (on first use; reconnects as needed).
    pub fn connect_lazy(&self, endpoint: &Endpoint) -> Channel {
        let inner = match &self.tls {
            Some(tls) => endpoint.connect_with_connector_lazy(Connector::new(tls.clone())),
            None => endpoint.connect_lazy(),
        };
        self.wrap(inner)
    }

    /// Connects now.
    pub async fn connect(&self, endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
        let inner = match &self.tls {
            Some(tls) => {
                endpoint
                    .connect_with_connector(Connector::new(tls.clone()))
                    .await?
            }
            None => endpoint.connect().await?,
        };
        Ok(self.wrap(inner))
    }

    fn wrap(&self, inner: tonic::transport::Channel) -> Channel {
        let authorization = self.token.as_ref().and_then(|t| {
            let mut value = HeaderValue::from_str(&format!("Bearer {t}")).ok()?;
            value.set_sensitive(true);
            Some(value)
        });
        Channel {
            inner,
            authorization,
        }
    }
}

/// A gRPC channel that adds `authorization: Bearer <token>` and the
/// caller's W3C trace context (`traceparent`) to every request; clone it freely (clones share the connection).
#[derive(Clone, Debug)]
pub struct Channel {
    inner: tonic::transport::Channel,
    authorization: Option<HeaderValue>,
}

impl Channel {
    /// The same connection, sending `token` instead of the channel's own
    /// (a gateway acting for its callers); `None` if the token cannot be a
    /// header value.
    pub fn with_token(&self, token: &str) -> Option<Channel> {
        let mut value = HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
        value.set_sensitive(true);
        Some(Channel {
            inner: self.inner.clone(),
            authorization: Some(value),
        })
    }
}

impl tower::Service<http::Request<Body>> for Channel {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = tonic::transport::channel::ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // The caller's span (tonic calls this inside the caller's future).
        crate::trace_context::inject(&tracing::Span::current(), request.headers_mut());
        if let Some(value) = &self.authorization {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, value.clone());
        }
        tower::Service::call(&mut self.inner, request)
    }
}
