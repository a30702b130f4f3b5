//! `POST /v1/embeddings`: sentence embeddings by the workers' retrieval
//! encoder (the model memory is ranked with), in OpenAI's shape.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use inferscale_proto as pb;
use serde_json::json;

use crate::error::{ApiError, Result};
use crate::openai::EmbeddingsRequest;
use crate::state::{Shared, body, tenant};
use crate::workers::request;
use inferscale_types::check_user;

pub(crate) async fn embeddings(
    State(s): State<Shared>,
    headers: HeaderMap,
    b: std::result::Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>> {
    tenant(&s, &headers)?;
    let mut r: EmbeddingsRequest = crate::validate::parse(&body(b, s.defaults.body_limit)?)?;
    let texts = r.texts()?;
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::param("encoding_format", format!("{other:?} is not one of \"float\", \"base64\"")));
        }
    };
    if let Some(u) = &r.user {
        check_user(u)?;
    }
    // Any healthy worker: the encoder is the same everywhere and no memory
    // is read. The user (if any) only spreads the load.
    let w = s.workers.any(r.user.as_deref().unwrap_or(""), &[])?;
    let req = pb::EmbedRequest { model: r.model.clone(), input: texts };
    let out = w.worker().client().embed(request(req, s.defaults.deadline)).await?.into_inner();
    let width = out.data.first().map_or(0, |e| e.values.len());
    if let Some(d) = r.dimensions
        && d as usize != width
    {
        return Err(ApiError::param(
            "dimensions",
            format!("{d}: the model `{}` embeds in {width} dimensions only", out.model),
        ));
    }
    let data: Vec<serde_json::Value> = out
        .data
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let embedding = match base64 {
                true => {
                    json!(crate::b64::standard(&e.values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
                }
                false => json!(e.values),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": out.model,
        "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens},
    })))
}
