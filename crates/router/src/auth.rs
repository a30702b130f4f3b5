//! API keys: each key (`Authorization: Bearer <key>`, or Mem0's `Token <key>`) belongs to a tenant, and a tenant's user ids
//! live in its own namespace, so one tenant can never name another's users.
//!
//! Keys come from a file (`--api-keys FILE`: one `tenant:key` per line,
//! `#` comments) or the environment (`INFERSCALE_API_KEYS=tenant:key,…`).
//! With no keys configured every request is accepted as tenant `default`.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{ApiError, Result};

#[derive(Debug, Clone, Default)]
pub struct Keys {
    by_key: HashMap<String, String>,
}

impl Keys {
    /// Parses `tenant:key` entries; `origin` names the source in errors.
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>, origin: &str) -> Result<Keys> {
        let mut by_key = HashMap::new();
        for (i, line) in entries.into_iter().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| ApiError::BadRequest(format!("{origin}: entry {}: {why}", i + 1));
            let (tenant, key) = line.split_once(':').ok_or_else(|| bad("expected `tenant:key`"))?;
            let (tenant, key) = (tenant.trim(), key.trim());
            if tenant.is_empty() || tenant.contains('/') {
                return Err(bad("the tenant is empty or contains `/`"));
            }
            if key.len() < 8 {
                return Err(bad("keys must be at least 8 characters"));
            }
            if by_key.insert(key.to_string(), tenant.to_string()).is_some() {
                return Err(bad("the same key appears twice"));
            }
        }
        Ok(Keys { by_key })
    }

    pub fn from_file(path: &Path) -> Result<Keys> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ApiError::BadRequest(format!("{}: cannot read API keys: {e}", path.display())))?;
        Keys::parse(text.lines(), &path.display().to_string())
    }

    pub fn from_env_value(value: &str) -> Result<Keys> {
        Keys::parse(value.split(','), "INFERSCALE_API_KEYS")
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// The tenant of an `Authorization` header value.
    pub fn tenant(&self, authorization: Option<&str>) -> Result<String> {
        if self.by_key.is_empty() {
            return Ok("default".into());
        }
        let header = authorization
            .ok_or_else(|| ApiError::Unauthorized("missing API key: send `Authorization: Bearer <key>`".into()))?;
        // `Token` is the scheme Mem0's clients send.
        let key = header.strip_prefix("Bearer ").or_else(|| header.strip_prefix("Token ")).ok_or_else(|| {
            ApiError::Unauthorized("the Authorization header must be `Bearer <key>` (or Mem0's `Token <key>`)".into())
        })?;
        self.by_key.get(key.trim()).cloned().ok_or_else(|| ApiError::Unauthorized("invalid API key".into()))
    }
}

/// The worker-side id of `tenant`'s `user`.
pub fn scoped(tenant: &str, user: &str) -> String {
    format!("{tenant}/{user}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_reject_bad_entries() {
        let k = Keys::parse(["# comment", "acme:sk-acme-123", " beta : sk-beta-456 "], "test").unwrap_or_default();
        assert_eq!(k.tenant(Some("Bearer sk-acme-123")).ok().as_deref(), Some("acme"));
        assert_eq!(k.tenant(Some("Bearer sk-beta-456")).ok().as_deref(), Some("beta"));
        assert_eq!(k.tenant(Some("Token sk-beta-456")).ok().as_deref(), Some("beta"));
        assert!(matches!(k.tenant(Some("Bearer nope-nope-nope")), Err(ApiError::Unauthorized(_))));
        assert!(matches!(k.tenant(None), Err(ApiError::Unauthorized(_))));
        assert!(matches!(k.tenant(Some("sk-acme-123")), Err(ApiError::Unauthorized(_))));
        assert!(Keys::parse(["nocolon"], "t").is_err());
        assert!(Keys::parse(["a:short"], "t").is_err());
        assert!(Keys::parse(["a/b:longenough"], "t").is_err());
        assert!(Keys::parse(["a:longenough", "b:longenough"], "t").is_err());
        assert_eq!(Keys::default().tenant(None).ok().as_deref(), Some("default"));
    }
}
