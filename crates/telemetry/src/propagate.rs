//! W3C trace context across process boundaries.
//!
//! The router continues a client's trace from its HTTP `traceparent`
//! header and hands its own span's context to workers in gRPC metadata;
//! the worker (and a worker streaming a shard to another) continues from
//! that metadata. With tracing off the global propagator is a no-op:
//! nothing is written, nothing is read.

use opentelemetry::propagation::{Extractor, Injector};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct MetadataWriter<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (tonic::metadata::MetadataKey::from_bytes(key.as_bytes()), value.parse()) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataReader<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct HeaderReader<'a>(&'a http::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes `span`'s context into an outgoing gRPC request's metadata.
pub fn inject(span: &Span, metadata: &mut tonic::metadata::MetadataMap) {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataWriter(metadata)));
}

/// Writes the current span's context into an outgoing gRPC request.
pub fn inject_current<T>(request: &mut tonic::Request<T>) {
    inject(&Span::current(), request.metadata_mut());
}

/// Makes `span` continue the trace named in an incoming gRPC request's
/// metadata (it stays a root when there is none).
pub fn continue_from_metadata(span: &Span, metadata: &tonic::metadata::MetadataMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataReader(metadata)));
    set_parent(span, cx);
}

/// Makes `span` continue the trace named in incoming HTTP headers.
pub fn continue_from_headers(span: &Span, headers: &http::HeaderMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderReader(headers)));
    set_parent(span, cx);
}

fn set_parent(span: &Span, cx: opentelemetry::Context) {
    use opentelemetry::trace::TraceContextExt as _;
    if cx.span().span_context().is_valid() {
        // Fails only for a span already started or disabled; either way
        // it keeps its own root, which is all that can be done.
        let _ = span.set_parent(cx);
    }
}
