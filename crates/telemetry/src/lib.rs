//! Traces and metrics for the router and the worker.
//!
//! **Traces.** Spans are written with `tracing` everywhere in the project;
//! this crate turns them into OpenTelemetry spans and exports them over
//! OTLP when, and only when, the standard variables ask for it
//! (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
//! or `OTEL_TRACES_EXPORTER=otlp`). With none of them set no subscriber is
//! installed, so every span macro is a disabled no-op: tracing off costs a
//! relaxed atomic load per span. The transport follows
//! `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`grpc` or `http/protobuf`, the
//! latter by default as the specification says); the service name follows
//! `OTEL_SERVICE_NAME`, sampling `OTEL_TRACES_SAMPLER`, batching
//! `OTEL_BSP_*`. Context crosses processes as W3C `traceparent`: the
//! router reads it from HTTP clients and writes it into gRPC metadata, the
//! worker reads it there ([`propagate`]).
//!
//! **Metrics.** [`prom`] renders Prometheus text exposition from a few
//! atomics; no metrics framework is needed for a handful of series.

pub mod prom;
pub mod propagate;

use std::future::Future;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("{var}={value:?}: {reason}")]
    Env { var: &'static str, value: String, reason: &'static str },
    #[error("a tracing subscriber is already installed")]
    AlreadyInstalled,
    #[error("tracing must be set up inside a Tokio runtime (the exporters run on it)")]
    NoRuntime,
}

/// Whether the environment asks for traces to be exported.
pub fn enabled_by_env() -> Result<bool, TelemetryError> {
    enabled(|k| std::env::var(k).ok())
}

fn enabled(var: impl Fn(&str) -> Option<String>) -> Result<bool, TelemetryError> {
    let set = |k: &str| var(k).is_some_and(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(false);
    }
    match var("OTEL_TRACES_EXPORTER").map(|v| v.trim().to_ascii_lowercase()) {
        Some(v) if v == "none" => return Ok(false),
        Some(v) if v == "otlp" => return Ok(true),
        Some(v) if !v.is_empty() => {
            return Err(TelemetryError::Env {
                var: "OTEL_TRACES_EXPORTER",
                value: v,
                reason: "only `otlp` and `none` are supported",
            });
        }
        _ => {}
    }
    Ok(set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Keeps the exporter alive; [`Tracing::shutdown`] flushes what is queued.
#[derive(Debug)]
pub struct Tracing {
    provider: Option<SdkTracerProvider>,
}

impl Tracing {
    /// Whether spans are exported.
    pub fn is_on(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still queued and stops the exporter. Runs the
    /// blocking flush off the async workers so the exporter, which uses
    /// the same runtime, can make progress.
    pub async fn shutdown(mut self) {
        if let Some(p) = self.provider.take() {
            let _ = tokio::task::spawn_blocking(move || p.shutdown()).await;
        }
    }
}

/// Installs the OpenTelemetry pipeline if the environment asks for it
/// (see the crate docs); otherwise installs nothing and returns a guard
/// that does nothing. `service` names the process when
/// `OTEL_SERVICE_NAME` does not. Must run inside a Tokio runtime.
pub fn init(service: &str) -> Result<Tracing, TelemetryError> {
    if !enabled_by_env()? {
        return Ok(Tracing { provider: None });
    }
    let handle = tokio::runtime::Handle::try_current().map_err(|_| TelemetryError::NoRuntime)?;
    let exporter = OnRuntime { inner: opentelemetry_otlp::SpanExporter::builder().build()?, handle };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
        resource = resource.with_service_name(service.to_string());
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let tracer = provider.tracer("inferscale");
    // Only the project's own spans: the libraries under it (tonic, h2,
    // hyper) have spans of their own at debug level that say nothing a
    // request's trace needs.
    let filter = Targets::new().with_target("inferscale", LevelFilter::INFO);
    let subscriber = tracing_subscriber::registry().with(
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            // Durations are the spans' own; source locations, threads
            // and busy/idle counters would only make every span bigger.
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(filter),
    );
    tracing::subscriber::set_global_default(subscriber).map_err(|_| TelemetryError::AlreadyInstalled)?;
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    Ok(Tracing { provider: Some(provider) })
}

/// Runs an exporter's futures inside a Tokio runtime's context.
///
/// The SDK's batch processor exports from a thread of its own, polling
/// with a plain executor; both OTLP transports (tonic, hyper) need the
/// Tokio reactor and timer. Entering the runtime on every poll gives them
/// both, and the runtime's own threads drive the I/O.
#[derive(Debug)]
struct OnRuntime {
    inner: opentelemetry_otlp::SpanExporter,
    handle: tokio::runtime::Handle,
}

impl SpanExporter for OnRuntime {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        let handle = self.handle.clone();
        let mut fut = Box::pin(self.inner.export(batch));
        std::future::poll_fn(move |cx| {
            let _entered = handle.enter();
            fut.as_mut().poll(cx)
        })
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _entered = self.handle.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<bool, TelemetryError> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        enabled(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn off_unless_an_endpoint_or_the_exporter_is_named() {
        assert!(!with(&[]).unwrap());
        assert!(!with(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]).unwrap());
        assert!(with(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")]).unwrap());
        assert!(with(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")]).unwrap());
        assert!(with(&[("OTEL_TRACES_EXPORTER", "otlp")]).unwrap());
    }

    #[test]
    fn disabling_wins_and_unknown_exporters_are_named() {
        let ep = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        assert!(!with(&[ep, ("OTEL_SDK_DISABLED", "true")]).unwrap());
        assert!(!with(&[ep, ("OTEL_TRACES_EXPORTER", "none")]).unwrap());
        let e = with(&[("OTEL_TRACES_EXPORTER", "zipkin")]).unwrap_err().to_string();
        assert!(e.contains("OTEL_TRACES_EXPORTER") && e.contains("zipkin"), "{e}");
    }
}
