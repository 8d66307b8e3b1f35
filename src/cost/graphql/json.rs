//! JSON as the coster reads it: `serde_json`'s reading, except that an object holding a
//! name twice is an error.
//!
//! RFC 8259 (section 4) says the names within an object SHOULD be unique, and that
//! implementations differ on which of two they keep: `serde_json` keeps the last, a
//! first-match lookup (some gateways') the first. Costing one `query`, `operationName` or
//! variable value while the server runs the other would charge a cheap query for a
//! costly one, so such a body is refused, as a URL parameter given twice is.

use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value as Json;

/// Reads `text` as one JSON value with no name twice in any of its objects.
pub(super) fn parse(text: &[u8]) -> Result<Json, serde_json::Error> {
    // First a pass that reads names only; then `serde_json` builds the value itself, so
    // that what it makes of a number is its own whatever features a build unifies
    // (`arbitrary_precision` hands numbers to a visitor as maps).
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    UniqueNames.deserialize(&mut deserializer)?;
    deserializer.end()?;
    serde_json::from_slice(text)
}

/// Reads a JSON value for nothing but its objects' names: an error for an object that
/// holds one twice. `serde_json`'s deserializer still bounds the nesting (128 levels).
#[derive(Clone, Copy)]
struct UniqueNames;

impl<'de> DeserializeSeed<'de> for UniqueNames {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// Visitor methods that accept a scalar and read nothing of it.
macro_rules! ignore_scalars {
    ($($method:ident: $scalar:ty),*) => {
        $(
            fn $method<E>(self, _: $scalar) -> Result<(), E> {
                Ok(())
            }
        )*
    };
}

impl<'de> Visitor<'de> for UniqueNames {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    // Scalars hold no names.
    ignore_scalars!(
        visit_bool: bool,
        visit_i64: i64,
        visit_u64: u64,
        visit_i128: i128,
        visit_u128: u128,
        visit_f64: f64,
        visit_str: &str
    );

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut names = BTreeSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if names.contains(&name) {
                // At most 64 characters of it: the answer echoes no client's megabyte.
                let shown: String = name.chars().take(64).collect();
                let cut = if shown.len() < name.len() { "..." } else { "" };
                return Err(de::Error::custom(format_args!(
                    "the name {shown:?}{cut} twice in one object (servers differ on which \
                     they read)"
                )));
            }
            map.next_value_seed(self)?;
            names.insert(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    /// What serde_json reads is read alike; a name twice at any depth is an error that
    /// says which; what follows the value is refused as serde_json refuses it.
    #[test]
    fn reads_json_as_serde_json_does_but_no_name_twice() {
        for text in [
            r#"{"a":[1,-2,3.5,"x",null,true,{"b":{}}],"c":{"d":[]}}"#,
            " [] ",
            r#""\ud83d\ude00""#,
            "18446744073709551615",
        ] {
            let ours = parse(text.as_bytes()).unwrap();
            let theirs: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(ours, theirs, "{text}");
        }
        for (text, name) in [
            (r#"{"a":1,"a":2}"#, "\"a\""),
            (r#"{"a":{"b":1,"c":2,"b":3}}"#, "\"b\""),
            (r#"[{"q":1},{"q":1,"q":1}]"#, "\"q\""),
            // The same name however it is escaped.
            (r#"{"query":1,"\u0071uery":2}"#, "\"query\""),
        ] {
            let error = parse(text.as_bytes()).unwrap_err().to_string();
            assert!(
                error.contains(name) && error.contains("twice"),
                "{text}: {error}"
            );
        }
        // A long name is not echoed whole.
        let long = "x".repeat(100_000);
        let error = parse(format!(r#"{{"{long}":1,"{long}":2}}"#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            error.len() < 300 && error.contains("\"... twice"),
            "{error}"
        );
        for text in [r#"{"a":1} {"a":2}"#, "[1,]", r#"{"a":1,}"#, "\"\\ud800\""] {
            assert!(parse(text.as_bytes()).is_err(), "{text}");
            assert!(serde_json::from_str::<serde_json::Value>(text).is_err());
        }
    }
}
