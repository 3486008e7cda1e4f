//! The Engram bucket layout: one prime-sized bucket range per (engram layer, n-gram size, head),
//! primes handed out in order and never reused, offsets the running sums within a layer.

/// Deterministic primality for any `u64` (Miller–Rabin with the first 12 prime bases, which is
/// exact below 3.3·10²⁴).
pub fn is_prime(n: u64) -> bool {
    const BASES: [u64; 12] = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37];
    if n < 2 {
        return false;
    }
    for &p in &BASES {
        if n.is_multiple_of(p) {
            return n == p;
        }
    }
    let mul_mod = |a: u64, b: u64| ((u128::from(a) * u128::from(b)) % u128::from(n)) as u64;
    let pow_mod = |mut base: u64, mut exp: u64| {
        let mut acc = 1_u64;
        while exp > 0 {
            if exp & 1 == 1 {
                acc = mul_mod(acc, base);
            }
            base = mul_mod(base, base);
            exp >>= 1;
        }
        acc
    };
    let odd_part_shift = (n - 1).trailing_zeros();
    let odd_part = (n - 1) >> odd_part_shift;
    'bases: for &a in &BASES {
        let mut x = pow_mod(a, odd_part);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..odd_part_shift {
            x = mul_mod(x, x);
            if x == n - 1 {
                continue 'bases;
            }
        }
        return false;
    }
    true
}

/// Primes, offsets and table sizes of every engram layer. Columns are n-gram-major then head:
/// column `(n − 2)·n_heads + h` belongs to n-gram size `n` and head `h`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramLayout {
    /// `[layer][column]` bucket modulus.
    pub primes: Vec<Vec<u64>>,
    /// `[layer][column]` first table row of the bucket range.
    pub offsets: Vec<Vec<u64>>,
    /// Table rows per layer (the sum of its primes).
    pub table_rows: Vec<u64>,
}

impl EngramLayout {
    /// For each of `n_layers` layers, for n = 2..=`max_ngram`, for each head: the smallest prime
    /// above the running value that no earlier column took; the running value restarts at
    /// `bucket_start − 1` for every n-gram size.
    pub fn compute(
        n_layers: usize,
        max_ngram: usize,
        n_heads: usize,
        bucket_start: u64,
    ) -> EngramLayout {
        let mut used = std::collections::HashSet::new();
        let mut primes = Vec::with_capacity(n_layers);
        let mut offsets = Vec::with_capacity(n_layers);
        let mut table_rows = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            let mut layer_primes = Vec::new();
            for _ngram in 2..=max_ngram {
                let mut current = bucket_start.saturating_sub(1);
                for _head in 0..n_heads {
                    current += 1;
                    while !is_prime(current) || used.contains(&current) {
                        current += 1;
                    }
                    used.insert(current);
                    layer_primes.push(current);
                }
            }
            let mut running = 0_u64;
            let layer_offsets = layer_primes
                .iter()
                .map(|&p| {
                    let offset = running;
                    running += p;
                    offset
                })
                .collect();
            primes.push(layer_primes);
            offsets.push(layer_offsets);
            table_rows.push(running);
        }
        EngramLayout {
            primes,
            offsets,
            table_rows,
        }
    }

    /// The table rows per layer as counts (`EngramConfig::num_embeddings`' spelling).
    pub fn num_embeddings(&self) -> Vec<usize> {
        self.table_rows.iter().map(|&rows| rows as usize).collect()
    }

    /// Hash columns per layer: `(max_ngram − 1) · n_heads`.
    pub fn columns(&self) -> usize {
        self.primes.first().map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primality_agrees_with_trial_division() {
        let trial = |n: u64| {
            n >= 2
                && (2..)
                    .take_while(|d| d * d <= n)
                    .all(|d| !n.is_multiple_of(d))
        };
        for n in 0..20_000 {
            assert_eq!(is_prime(n), trial(n), "n = {n}");
        }
        assert!(is_prime(18_446_744_073_709_551_557)); // largest u64 prime
        assert!(!is_prime(3_215_031_751)); // strong pseudoprime to bases 2, 3, 5, 7
    }

    /// The fixture's layout (`case.json` → `engram`: layers 1 and 4, 2 heads, max n-gram 4,
    /// vocab 100).
    #[test]
    fn fixture_layout() {
        let layout = EngramLayout::compute(2, 4, 2, 100);
        assert_eq!(
            layout.primes,
            [
                vec![101, 103, 107, 109, 113, 127],
                vec![131, 137, 139, 149, 151, 157]
            ]
        );
        assert_eq!(
            layout.offsets,
            [
                vec![0, 101, 204, 311, 420, 533],
                vec![0, 131, 268, 407, 556, 707]
            ]
        );
        assert_eq!(layout.table_rows, [660, 864]);
        assert_eq!(layout.columns(), 6);
    }

    /// The released model (spec §3.7 table): layers 1 and 14, 8 heads, vocab 16 000 000.
    #[test]
    fn released_model_layout() {
        let layout = EngramLayout::compute(2, 4, 8, 16_000_000);
        assert_eq!(layout.table_rows, [384_006_168, 384_016_682]);
        assert_eq!(
            layout.primes[0],
            [
                16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
                16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
                16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463
            ]
        );
        assert_eq!(
            layout.primes[1],
            [
                16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
                16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
                16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889
            ]
        );
        assert_eq!(layout.offsets[1][1], 16_000_477);
        assert_eq!(layout.offsets[1][23], 384_016_682 - 16_000_889);
    }
}
