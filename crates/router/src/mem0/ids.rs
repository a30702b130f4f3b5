//! Mem0 memory ids. Mem0's API names a memory by its id alone
//! (`GET /v1/memories/{id}/`), while our memory is placed per user: a unit
//! id is unique within its user only, and the router finds the worker from
//! the user. So a Mem0 id carries both — `m1.<user>.<unit>`, each part in
//! unpadded base64url — and routes without an index: no second store to keep
//! consistent with the workers', nothing to rebuild when a shard moves, and
//! an id that survives restarts and moves unchanged. The tenant is not in
//! it: it comes from the API key, so an id shown to one tenant names
//! nothing in another's namespace.

use crate::b64;

const PREFIX: &str = "m1.";

/// The Mem0 id of `user`'s unit `unit`.
pub fn encode(user: &str, unit: &str) -> String {
    format!("{PREFIX}{}.{}", b64::url(user.as_bytes()), b64::url(unit.as_bytes()))
}

/// The user and unit a Mem0 id names; `None` for a string that is not one.
pub fn decode(id: &str) -> Option<(String, String)> {
    let (user, unit) = id.strip_prefix(PREFIX)?.split_once('.')?;
    let text = |s: &str| String::from_utf8(b64::from_url(s)?).ok().filter(|t| !t.is_empty());
    Some((text(user)?, text(unit)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_user_and_unit_and_refuse_anything_else() {
        for (user, unit) in [("alex", "msg-00ff"), ("a/b c", "D1:3"), ("ünï", "x"), ("ab", "abc"), ("abcd", "a.b")] {
            let id = encode(user, unit);
            assert!(id.bytes().all(|c| c.is_ascii_alphanumeric() || b".-_".contains(&c)), "{id}");
            assert_eq!(decode(&id), Some((user.to_string(), unit.to_string())), "{id}");
        }
        for bad in ["", "m1.", "m1.YWxleA", "m1..eA", "m2.YWxleA.eA", "m1.Y.eA", "m1.YWxleA.e*", "3fa85f64-5717"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
