//! The token layout of an image span (spec §4.2):
//! `[START] + ([IMAGE] × n_llm_w + [NEWLINE]) × n_llm_h + [END]`, every position holding the image
//! token id, and the per-row embeddings / image flags of a chunk with image spans placed in it.

use super::{Delimiters, EncodedImage, VisionError};

/// The role of a prompt position (the reference's `token_types`: −1 text, 0 start, 1 image,
/// 2 newline, 3 end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Text,
    ImageStart,
    Image,
    ImageNewLine,
    ImageEnd,
}

impl TokenType {
    /// The reference's integer code.
    pub fn code(self) -> i32 {
        match self {
            TokenType::Text => -1,
            TokenType::ImageStart => 0,
            TokenType::Image => 1,
            TokenType::ImageNewLine => 2,
            TokenType::ImageEnd => 3,
        }
    }

    /// Whether the position belongs to an image span (routes with `bias_vl`, dead to Engram).
    pub fn in_image_span(self) -> bool {
        self != TokenType::Text
    }
}

/// The token types of one image span of an `n_llm_h × n_llm_w` grid.
pub fn span_token_types(n_llm_h: usize, n_llm_w: usize) -> Vec<TokenType> {
    let mut types = Vec::with_capacity(n_llm_h * (n_llm_w + 1) + 2);
    types.push(TokenType::ImageStart);
    for _ in 0..n_llm_h {
        types.extend(std::iter::repeat_n(TokenType::Image, n_llm_w));
        types.push(TokenType::ImageNewLine);
    }
    types.push(TokenType::ImageEnd);
    types
}

/// A prompt whose image placeholders have been expanded into image spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandedPrompt {
    /// The prompt with every placeholder replaced by its span (all `image_token`).
    pub tokens: Vec<u32>,
    /// Where each image's span starts, in image order.
    pub image_starts: Vec<usize>,
}

/// Expands every `image_token` of `tokens` (one per image, in order) into that image's span of
/// `image_token`s, as the reference's `prepare_vl_inputs` does.
pub fn expand_image_placeholders(
    tokens: &[u32],
    image_token: u32,
    images: &[EncodedImage],
) -> Result<ExpandedPrompt, VisionError> {
    let placeholders = tokens.iter().filter(|&&t| t == image_token).count();
    if placeholders != images.len() {
        return Err(VisionError::PlaceholderCount {
            placeholders,
            images: images.len(),
        });
    }
    let mut expanded =
        Vec::with_capacity(tokens.len() + images.iter().map(EncodedImage::span_len).sum::<usize>());
    let mut image_starts = Vec::with_capacity(images.len());
    let mut next_image = images.iter().peekable();
    for &token in tokens {
        // One image per placeholder (counted above).
        match next_image.next_if(|_| token == image_token) {
            Some(image) => {
                image_starts.push(expanded.len());
                expanded.extend(std::iter::repeat_n(image_token, image.span_len()));
            }
            None => expanded.push(token),
        }
    }
    Ok(ExpandedPrompt {
        tokens: expanded,
        image_starts,
    })
}

/// An encoded image whose span starts at chunk row `start`.
#[derive(Debug, Clone, Copy)]
pub struct PlacedImage<'a> {
    pub start: usize,
    pub image: &'a EncodedImage,
}

/// Per-row image flags and replacement embeddings of one chunk.
#[derive(Debug)]
pub(crate) struct ChunkImages<'a> {
    image_rows: Vec<bool>,
    embeddings: Vec<Option<&'a [f32]>>,
}

impl<'a> ChunkImages<'a> {
    /// Checks every span (inside the chunk, not overlapping, holding `image_token`, rows matching
    /// the grid and `dim`) and lays out its rows.
    pub(crate) fn new(
        tokens: &[u32],
        images: &[PlacedImage<'a>],
        image_token: u32,
        dim: usize,
        delimiters: &'a Delimiters,
    ) -> Result<ChunkImages<'a>, VisionError> {
        let n = tokens.len();
        let mut image_rows = vec![false; n];
        let mut embeddings: Vec<Option<&'a [f32]>> = vec![None; n];
        for placed in images {
            let image = placed.image;
            let cells = image.grid.n_cells();
            if image.rows.len() != cells * dim {
                return Err(VisionError::EncodedRows {
                    found: image.rows.len(),
                    expected: cells * dim,
                    cells,
                    dim,
                });
            }
            let types = image.token_types();
            let end = placed.start + types.len();
            if end > n {
                return Err(VisionError::SpanOutsideChunk {
                    start: placed.start,
                    end,
                    chunk: n,
                });
            }
            let mut cell_rows = image.rows.chunks_exact(dim);
            for (row, kind) in (placed.start..end).zip(types) {
                if image_rows[row] {
                    return Err(VisionError::SpanOverlap { row });
                }
                if tokens[row] != image_token {
                    return Err(VisionError::SpanToken {
                        row,
                        found: tokens[row],
                        expected: image_token,
                    });
                }
                image_rows[row] = true;
                embeddings[row] = match kind {
                    TokenType::ImageStart => Some(&delimiters.start[..]),
                    TokenType::ImageNewLine => Some(&delimiters.newline[..]),
                    TokenType::ImageEnd => Some(&delimiters.end[..]),
                    TokenType::Image => cell_rows.next(),
                    TokenType::Text => None,
                };
            }
        }
        Ok(ChunkImages {
            image_rows,
            embeddings,
        })
    }

    pub(crate) fn image_rows(&self) -> &[bool] {
        &self.image_rows
    }

    pub(crate) fn embeddings(&self) -> &[Option<&'a [f32]>] {
        &self.embeddings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v41::vision::ImageGrid;

    fn encoded(n_llm_h: usize, n_llm_w: usize, dim: usize) -> EncodedImage {
        EncodedImage {
            grid: ImageGrid {
                width: 14 * 3 * n_llm_w,
                height: 14 * 3 * n_llm_h,
                n_vit_h: 3 * n_llm_h,
                n_vit_w: 3 * n_llm_w,
                n_llm_h,
                n_llm_w,
            },
            rows: (0..n_llm_h * n_llm_w * dim).map(|v| v as f32).collect(),
        }
    }

    #[test]
    fn span_layout_puts_delimiters_and_cells_in_reading_order() {
        let codes: Vec<i32> = span_token_types(2, 3).iter().map(|t| t.code()).collect();
        assert_eq!(codes, [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]);
        let dim = 2;
        let delimiters = Delimiters {
            start: vec![-1.0; dim],
            newline: vec![-2.0; dim],
            end: vec![-3.0; dim],
        };
        let image = encoded(2, 1, dim);
        let tokens = [7, 9, 9, 9, 9, 9, 9, 8];
        let placed = [PlacedImage {
            start: 1,
            image: &image,
        }];
        let chunk = ChunkImages::new(&tokens, &placed, 9, dim, &delimiters).expect("layout");
        assert_eq!(
            chunk.image_rows(),
            [false, true, true, true, true, true, true, false]
        );
        let firsts: Vec<f32> = chunk
            .embeddings()
            .iter()
            .map(|e| e.map_or(f32::NAN, |row| row[0]))
            .collect();
        assert!(firsts[0].is_nan() && firsts[7].is_nan());
        assert_eq!(firsts[1..7], [-1.0, 0.0, -2.0, 2.0, -2.0, -3.0]);

        // Out of the chunk, wrong token, overlap, wrong row count.
        let late = [PlacedImage {
            start: 3,
            image: &image,
        }];
        assert!(matches!(
            ChunkImages::new(&tokens, &late, 9, dim, &delimiters),
            Err(VisionError::SpanOutsideChunk { end: 9, .. })
        ));
        assert!(matches!(
            ChunkImages::new(&tokens, &placed, 8, dim, &delimiters),
            Err(VisionError::SpanToken { row: 1, .. })
        ));
        let twice = [placed[0], placed[0]];
        assert!(matches!(
            ChunkImages::new(&tokens, &twice, 9, dim, &delimiters),
            Err(VisionError::SpanOverlap { row: 1 })
        ));
        assert!(matches!(
            ChunkImages::new(&tokens, &placed, 9, 3, &delimiters),
            Err(VisionError::EncodedRows { .. })
        ));
    }

    #[test]
    fn placeholders_expand_into_spans() {
        let small = encoded(1, 1, 2);
        let large = encoded(2, 3, 2);
        let prompt = expand_image_placeholders(&[5, 9, 6, 9, 7], 9, &[small.clone(), large])
            .expect("expand");
        // Spans of 1·(1 + 1) + 2 = 4 and 2·(3 + 1) + 2 = 10 positions.
        assert_eq!(prompt.image_starts, [1, 6]);
        let mut expect = vec![5];
        expect.extend([9; 4]);
        expect.push(6);
        expect.extend([9; 10]);
        expect.push(7);
        assert_eq!(prompt.tokens, expect);
        assert!(matches!(
            expand_image_placeholders(&[9, 9], 9, &[small]),
            Err(VisionError::PlaceholderCount {
                placeholders: 2,
                images: 1
            })
        ));
    }
}
