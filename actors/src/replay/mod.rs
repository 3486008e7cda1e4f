//! Decoder bounded replay: the kept prompt suffix of the decoder layers and the rewind bound.
pub mod suffix;
