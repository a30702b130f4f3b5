//! The memory shard: per-user facts (the durable source of truth), their
//! pre-RoPE KV encoded with a context window, retrieval and composition.

mod answer;
mod cache;
pub(crate) mod commit;
mod compose;
mod edit;
mod erase;
mod error;
mod fact;
pub mod faults;
mod fetch;
pub mod fidelity;
mod frame;
mod kvseg;
pub mod log;
mod manifest;
pub mod repair;
mod resident;
mod retrieval;
pub mod salvage;
mod scrub;
mod search;
mod session;
mod shard;
mod transfer;
mod user;
mod users;

pub use answer::{Facts, Prepared, prepare};
pub use cache::{Budgets, CacheStats, Tier};
pub use compose::{ANSWER_INSTRUCTION, Chat, Composer, MemoryTurn, Prompts, SYSTEM_PROMPT, USER_TURN_SYSTEM_PROMPT};
pub use edit::{UnitUpdate, UpdateReport};
pub use error::{MemoryError, Result};
pub use fact::{Event, EventKind, Fact};
pub use fetch::{FetchReport, Fetched, Pinned, ReadDone, ReadJob};
pub use inferscale_types::{MemoryUnit, Mode, Recall, Scope};
pub use kvseg::{KvFormat, KvHeader, StoredKv, read_segment};
pub use manifest::{MANIFEST, Manifest, check_unlocked, recorded_window};
pub use retrieval::{Query, Retriever};
pub use search::matches as filter_matches;
pub use session::{Hit, QUESTION_BATCH, Session};
pub use shard::{Footprint, IngestReport, Memory, ShardSpec, StoreOptions, fingerprint, user_dir_name, validate};
pub use transfer::{ImportReport, ShardRecord, StagedShard, Staging};
pub use user::Encoders;
pub use user::write_seq;
