//! JSON as the coster reads it: `serde_json`'s reading, except that an object holding a
//! name twice is an error.
//!
//! RFC 8259 (section 4) says the names within an object SHOULD be unique, and that
//! implementations differ on which of two they keep: `serde_json` keeps the last, a
//! first-match lookup (some gateways') the first. Costing one `query`, `operationName` or
//! variable value while the server runs the other would charge a cheap query for a
//! costly one, so such a body is refused, as a URL parameter given twice is.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value as Json};

/// Reads `text` as one JSON value with no name twice in any of its objects.
pub(super) fn parse(text: &[u8]) -> Result<Json, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    let value = UniqueNames.deserialize(&mut deserializer)?;
    // Nothing but whitespace after the value, as `serde_json::from_slice` asks.
    deserializer.end()?;
    Ok(value)
}

/// Builds a [`Json`] value, refusing an object that holds a name twice. `serde_json`'s
/// deserializer still bounds the nesting (128 levels).
#[derive(Clone, Copy)]
struct UniqueNames;

impl<'de> DeserializeSeed<'de> for UniqueNames {
    type Value = Json;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueNames {
    type Value = Json;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Json, E> {
        Ok(Json::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Json, E> {
        Ok(Json::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Json, E> {
        Ok(Json::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Json, E> {
        // JSON has no NaN or infinity: serde_json reads an out-of-range number as an error.
        Ok(Number::from_f64(value).map_or(Json::Null, Json::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Json, E> {
        Ok(Json::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Json, E> {
        Ok(Json::String(value))
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut values = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(value) = seq.next_element_seed(self)? {
            values.push(value);
        }
        Ok(Json::Array(values))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut object = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            if object.contains_key(&name) {
                return Err(de::Error::custom(format_args!(
                    "the name {name:?} twice in one object (servers differ on which they \
                     read)"
                )));
            }
            let value = map.next_value_seed(self)?;
            object.insert(name, value);
        }
        Ok(Json::Object(object))
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
        for text in [r#"{"a":1} {"a":2}"#, "[1,]", r#"{"a":1,}"#, "\"\\ud800\""] {
            assert!(parse(text.as_bytes()).is_err(), "{text}");
            assert!(serde_json::from_str::<serde_json::Value>(text).is_err());
        }
    }
}
