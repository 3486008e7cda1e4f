//! Strict scalar deserializers for the raw config: an integer field accepts only an integer
//! in range, a bool field only `true`/`false`, a text field only a string. (The `config`
//! crate would otherwise round `1.5` to 2, read `1` as `true` and `5` as `"5"`.)

use std::fmt;
use std::marker::PhantomData;

use serde::Deserializer;
use serde::de::{self, Unexpected, Visitor};

/// An optional non-negative integer that fits `T`.
pub(crate) fn uint<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    deserializer.deserialize_any(UintVisitor(PhantomData))
}

/// An optional boolean.
pub(crate) fn boolean<'de, D>(deserializer: D) -> Result<Option<bool>, D::Error>
where
    D: Deserializer<'de>,
{
    deserializer.deserialize_any(BoolVisitor)
}

/// An optional string.
pub(crate) fn text<'de, D>(deserializer: D) -> Result<Option<String>, D::Error>
where
    D: Deserializer<'de>,
{
    deserializer.deserialize_any(TextVisitor)
}

struct UintVisitor<T>(PhantomData<T>);

impl<T: TryFrom<u64>> Visitor<'_> for UintVisitor<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a non-negative integer of at most {} bits",
            8 * size_of::<T>()
        )
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        T::try_from(value)
            .map(Some)
            .map_err(|_| E::invalid_value(Unexpected::Unsigned(value), &self))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        match u64::try_from(value) {
            Ok(unsigned) => self.visit_u64(unsigned),
            Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
        }
    }

    fn visit_u128<E: de::Error>(self, value: u128) -> Result<Self::Value, E> {
        self.visit_wide(u64::try_from(value).ok())
    }

    fn visit_i128<E: de::Error>(self, value: i128) -> Result<Self::Value, E> {
        self.visit_wide(u64::try_from(value).ok())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

impl<T: TryFrom<u64>> UintVisitor<T> {
    /// A 128-bit integer, `unsigned` where it fits a `u64`: read as that, else invalid.
    fn visit_wide<E: de::Error>(self, unsigned: Option<u64>) -> Result<Option<T>, E> {
        match unsigned {
            Some(unsigned) => self.visit_u64(unsigned),
            None => Err(E::invalid_value(
                Unexpected::Other("a 128-bit integer"),
                &self,
            )),
        }
    }
}

struct BoolVisitor;

impl Visitor<'_> for BoolVisitor {
    type Value = Option<bool>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("true or false")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Self::Value, E> {
        Ok(Some(value))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

struct TextVisitor;

impl Visitor<'_> for TextVisitor {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
        Ok(Some(value.to_owned()))
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Self::Value, E> {
        Ok(Some(value))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}
