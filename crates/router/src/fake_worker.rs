//! A worker answering over real gRPC on loopback from a test's script,
//! shared by the router's in-crate tests (dispatch, rebalancing): a test
//! scripts the calls it cares about ([`Scripted`]; each is refused as
//! unimplemented unless scripted), and the worker is always healthy.

use std::pin::Pin;

use futures_util::Stream;
use inferscale_proto as pb;
use inferscale_proto::worker_server::{Worker, WorkerServer};
use tonic::{Request, Response, Status};

pub(crate) type Answer<T> = std::result::Result<T, Status>;
pub(crate) type Events = Pin<Box<dyn Stream<Item = std::result::Result<pb::GenerateEvent, Status>> + Send>>;
type Chunks = Pin<Box<dyn Stream<Item = std::result::Result<pb::ShardChunk, Status>> + Send>>;

fn unused<T>() -> Answer<T> {
    Err(Status::unimplemented("not scripted"))
}

/// The calls a test scripts.
#[tonic::async_trait]
pub(crate) trait Scripted: Send + Sync + 'static {
    async fn ingest(&self, _: pb::IngestRequest) -> Answer<pb::IngestResponse> {
        unused()
    }
    async fn generate(&self, _: pb::GenerateRequest) -> Answer<Events> {
        unused()
    }
    async fn forget(&self, _: pb::ForgetRequest) -> Answer<pb::ForgetResponse> {
        unused()
    }
    async fn list_users(&self) -> Answer<pb::ListUsersResponse> {
        unused()
    }
    async fn send_shard(&self, _: pb::SendShardRequest) -> Answer<pb::SendShardResponse> {
        unused()
    }
    async fn release_shard(&self, _: pb::ReleaseShardRequest) -> Answer<pb::ReleaseShardResponse> {
        unused()
    }
}

struct Fake<S>(S);

fn respond<T>(a: Answer<T>) -> std::result::Result<Response<T>, Status> {
    a.map(Response::new)
}

#[tonic::async_trait]
impl<S: Scripted> Worker for Fake<S> {
    async fn ingest(&self, r: Request<pb::IngestRequest>) -> std::result::Result<Response<pb::IngestResponse>, Status> {
        respond(self.0.ingest(r.into_inner()).await)
    }

    type GenerateStream = Events;

    async fn generate(&self, r: Request<pb::GenerateRequest>) -> std::result::Result<Response<Events>, Status> {
        respond(self.0.generate(r.into_inner()).await)
    }

    async fn list_memories(
        &self,
        _: Request<pb::ListMemoriesRequest>,
    ) -> std::result::Result<Response<pb::ListMemoriesResponse>, Status> {
        respond(unused())
    }

    async fn search_memories(
        &self,
        _: Request<pb::SearchMemoriesRequest>,
    ) -> std::result::Result<Response<pb::SearchMemoriesResponse>, Status> {
        respond(unused())
    }

    async fn update_memory(
        &self,
        _: Request<pb::UpdateMemoryRequest>,
    ) -> std::result::Result<Response<pb::UpdateMemoryResponse>, Status> {
        respond(unused())
    }

    async fn unit_history(
        &self,
        _: Request<pb::UnitHistoryRequest>,
    ) -> std::result::Result<Response<pb::UnitHistoryResponse>, Status> {
        respond(unused())
    }

    async fn forget(&self, r: Request<pb::ForgetRequest>) -> std::result::Result<Response<pb::ForgetResponse>, Status> {
        respond(self.0.forget(r.into_inner()).await)
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> std::result::Result<Response<pb::HealthResponse>, Status> {
        respond(Ok(pb::HealthResponse { ready: true, model: "fake".into(), backend: "none".into() }))
    }

    async fn stats(&self, _: Request<pb::StatsRequest>) -> std::result::Result<Response<pb::StatsResponse>, Status> {
        respond(Ok(pb::StatsResponse::default()))
    }

    async fn embed(&self, _: Request<pb::EmbedRequest>) -> std::result::Result<Response<pb::EmbedResponse>, Status> {
        respond(unused())
    }

    async fn list_users(
        &self,
        _: Request<pb::ListUsersRequest>,
    ) -> std::result::Result<Response<pb::ListUsersResponse>, Status> {
        respond(self.0.list_users().await)
    }

    type ExportShardStream = Chunks;

    async fn export_shard(&self, _: Request<pb::ExportShardRequest>) -> std::result::Result<Response<Chunks>, Status> {
        respond(unused())
    }

    async fn import_shard(
        &self,
        _: Request<tonic::Streaming<pb::ShardChunk>>,
    ) -> std::result::Result<Response<pb::ImportShardResponse>, Status> {
        respond(unused())
    }

    async fn send_shard(
        &self,
        r: Request<pb::SendShardRequest>,
    ) -> std::result::Result<Response<pb::SendShardResponse>, Status> {
        respond(self.0.send_shard(r.into_inner()).await)
    }

    async fn release_shard(
        &self,
        r: Request<pb::ReleaseShardRequest>,
    ) -> std::result::Result<Response<pb::ReleaseShardResponse>, Status> {
        respond(self.0.release_shard(r.into_inner()).await)
    }
}

/// Serves `script` on a loopback port until the test's runtime ends;
/// returns its address.
pub(crate) async fn serve(script: impl Scripted) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder().add_service(WorkerServer::new(Fake(script))).serve_with_incoming(incoming),
    );
    addr
}
