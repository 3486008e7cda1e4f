//! Typed reading of one JSON object of a `config.json`: every accessor names the file and the
//! dotted field (`text_config.hidden_size`) when the field is missing or has the wrong type.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ModelError;

/// Reads typed fields out of one JSON object and names `<prefix><key>` and the file on error.
pub(crate) struct Fields<'a> {
    pub(crate) object: &'a Map<String, Value>,
    pub(crate) prefix: &'static str,
    pub(crate) file: &'a Path,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(
        value: &'a Value,
        prefix: &'static str,
        file: &'a Path,
    ) -> Result<Self, ModelError> {
        let object = value.as_object().ok_or_else(|| ModelError::Config {
            file: file.to_path_buf(),
            field: prefix.trim_end_matches('.').to_string(),
            message: format!("expected a JSON object, found {}", json_kind(value)),
        })?;
        Ok(Fields {
            object,
            prefix,
            file,
        })
    }

    pub(crate) fn error(&self, key: &str, message: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: self.file.to_path_buf(),
            field: format!("{}{key}", self.prefix),
            message: message.into(),
        }
    }

    pub(crate) fn optional(&self, key: &str) -> Option<&'a Value> {
        self.object.get(key).filter(|value| !value.is_null())
    }

    pub(crate) fn value(&self, key: &str) -> Result<&'a Value, ModelError> {
        self.object
            .get(key)
            .ok_or_else(|| self.error(key, "missing required field"))
    }

    pub(crate) fn mismatch(&self, key: &str, expected: &str, found: &Value) -> ModelError {
        self.error(key, format!("expected {expected}, found {found}"))
    }

    pub(crate) fn usize_of(&self, key: &str, value: &Value) -> Result<usize, ModelError> {
        value
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| self.mismatch(key, "a non-negative integer", value))
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.usize_of(key, self.value(key)?)
    }

    pub(crate) fn u32(&self, key: &str) -> Result<u32, ModelError> {
        let value = self.value(key)?;
        value
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| self.mismatch(key, "a 32-bit token id", value))
    }

    pub(crate) fn optional_u32(&self, key: &str) -> Result<Option<u32>, ModelError> {
        match self.optional(key) {
            None => Ok(None),
            Some(_) => self.u32(key).map(Some),
        }
    }

    pub(crate) fn f64(&self, key: &str) -> Result<f64, ModelError> {
        let value = self.value(key)?;
        value
            .as_f64()
            .filter(|v| v.is_finite())
            .ok_or_else(|| self.mismatch(key, "a finite number", value))
    }

    pub(crate) fn f32(&self, key: &str) -> Result<f32, ModelError> {
        Ok(self.f64(key)? as f32)
    }

    pub(crate) fn bool(&self, key: &str) -> Result<bool, ModelError> {
        let value = self.value(key)?;
        value
            .as_bool()
            .ok_or_else(|| self.mismatch(key, "true or false", value))
    }

    pub(crate) fn str(&self, key: &str) -> Result<&'a str, ModelError> {
        let value = self.value(key)?;
        value
            .as_str()
            .ok_or_else(|| self.mismatch(key, "a string", value))
    }

    pub(crate) fn usize_list(&self, key: &str) -> Result<Vec<usize>, ModelError> {
        let value = self.value(key)?;
        let items = value
            .as_array()
            .ok_or_else(|| self.mismatch(key, "a list of integers", value))?;
        items.iter().map(|item| self.usize_of(key, item)).collect()
    }

    /// Requires `key` to hold exactly `expected` (a string).
    pub(crate) fn expect_str(&self, key: &str, expected: &str) -> Result<(), ModelError> {
        let found = self.str(key)?;
        if found == expected {
            Ok(())
        } else {
            Err(self.error(key, format!("expected \"{expected}\", found \"{found}\"")))
        }
    }

    /// Requires `key` to hold exactly `expected` (a bool).
    pub(crate) fn expect_bool(&self, key: &str, expected: bool) -> Result<(), ModelError> {
        let found = self.bool(key)?;
        if found == expected {
            Ok(())
        } else {
            Err(self.error(key, format!("expected {expected}, found {found}")))
        }
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
